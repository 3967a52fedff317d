"""Package discovery for the wheel (the rest of the metadata is in pyproject.toml).

The three layers live side by side at the top of the repo; the wheel nests `passes/` and
`kernels/` under `dtmega` so nothing generic lands in site-packages. Sub-packages are found
automatically below each layer's folder (a hand-written list once missed `dtmega.cost`, and a
non-editable install could not import the parallelizer); setuptools' own `packages.find` cannot
map one folder onto a nested package name, hence this file.
"""

from setuptools import find_packages, setup

LAYERS = {"dtmega": "dtmega", "dtmega.passes": "passes", "dtmega.kernels": "kernels"}


def layer_packages() -> list[str]:
    """Every package of the three layers, named as installed (`dtmega.passes.families`, ...)."""
    packages = []
    for name, folder in LAYERS.items():
        packages.append(name)
        packages += [f"{name}.{sub}" for sub in find_packages(folder)]
    return packages


setup(packages=layer_packages(), package_dir=LAYERS)
