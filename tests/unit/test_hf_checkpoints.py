"""Hugging Face checkpoints in and out, on one rank: SmolLM2-135M (a real model) against
transformers, round trips, a Llama-3.1 and a Mixtral made by transformers, tokenizers in every
form, and each bad input's error.

Tolerances: logits within 1e-4 relative (max |difference| / max |logit|, fp32): the two
implementations order their reductions differently (attention, RMSNorm, the 30-block residual
stream), ~1e-6 in practice. Round trips are bitwise: conversion only moves and reorders values.
The sharded plans (TP2+SP, PP2, FSDP2, EP2) are in tests/distributed/test_hf_checkpoints_parallel.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dtmega.cli import main as dtmega_main
from dtmega.data.tokenizers import SentencePieceTokenizer, TokenizerSpec, build_tokenizer, tokenizer_from_json
from dtmega.interop.hf_checkpoint import HFCheckpoint
from dtmega.models.llama import Llama
from dtmega.models.llama.hf_config import HFFormatError
from dtmega.models.llama.hf_names import dtmega_rows_to_hf, hf_rows_to_dtmega
from dtmega.train.generate import generate_tokens
from dtmega.train.restore import restore
from tests.hf_models import save_tiny_llama31, save_tiny_mixtral
from tests.smollm2 import PROMPT, prompt_ids, smollm2_dir, transformers_model

LOGITS_RTOL = 1e-4


def relative_max(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|."""
    return float((actual - expected).abs().max() / expected.abs().max())


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory, by name."""
    index = directory / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    out = {}
    for file in files:
        with safe_open(str(directory / file), framework="pt") as handle:
            out.update({name: handle.get_tensor(name) for name in handle.keys()})
    return out


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name


def loaded_unsharded(directory: Path) -> Llama:
    checkpoint = HFCheckpoint.open(directory)
    with torch.device("meta"):
        model = Llama(checkpoint.config)
    model.to_empty(device="cpu")
    model.init_buffers(torch.device("cpu"))
    checkpoint.load_into(model)
    return model.eval()


def test_rope_row_permutation_round_trips_and_matches_the_rotation():
    """The one layout difference: dtmega's pairs (2i, 2i+1) are HF's (i, i + d/2)."""
    weight = torch.randn(3 * 8, 5)
    assert torch.equal(dtmega_rows_to_hf(hf_rows_to_dtmega(weight, 3), 3), weight)
    ours = hf_rows_to_dtmega(weight, 3).view(3, 4, 2, 5)  # [head, pair, member, in]
    theirs = weight.view(3, 2, 4, 5)  # [head, half, i, in]
    assert torch.equal(ours[:, :, 0], theirs[:, 0]) and torch.equal(ours[:, :, 1], theirs[:, 1])


def test_smollm2_logits_and_greedy_generation_equal_transformers():
    """SmolLM2-135M read by `--load-hf`'s path (restore on a 1-rank mesh): logits on the prompt
    within 1e-4, and 30 greedy tokens identical to transformers.generate."""
    directory = smollm2_dir()
    pm, tokenizer, state = restore(None, load_hf=directory)
    assert state["model_config"]["n_layers"] == 30 and tokenizer.vocab_size == 49152
    reference = transformers_model()
    ids = prompt_ids(tokenizer)
    with torch.no_grad():
        ours, theirs = pm.module(ids), reference(ids).logits
    assert relative_max(ours, theirs) < LOGITS_RTOL
    produced = generate_tokens(pm.module, ids[0].tolist(), vocab_size=tokenizer.vocab_size, eod=tokenizer.eod,
                               max_new_tokens=30, temperature=0.0)
    expected = reference.generate(ids, max_new_tokens=30, do_sample=False, attention_mask=torch.ones_like(ids),
                                  pad_token_id=tokenizer.eod)[0, ids.shape[1]:].tolist()
    if expected and expected[-1] == tokenizer.eod:  # transformers keeps the end token; dtmega stops before it
        expected = expected[:-1]
    assert produced.ids == expected, (tokenizer.decode(produced.ids), tokenizer.decode(expected))
    assert "Paris" in tokenizer.decode(produced.ids)


def test_smollm2_round_trip_hf_dtmega_hf_is_byte_identical(tmp_path):
    """`dtmega convert hf-to-dtmega` then `dtmega-to-hf`: every tensor bitwise and config.json
    byte for byte; transformers loads the result."""
    source = smollm2_dir()
    assert dtmega_main(["convert", "hf-to-dtmega", "--hf-dir", str(source), "--save", str(tmp_path / "ckpt")]) == 0
    assert dtmega_main(["convert", "dtmega-to-hf", "--load", str(tmp_path / "ckpt"), "--hf-dir", str(tmp_path / "hf"),
                        "--max-shard-size", "200MB"]) == 0
    assert (tmp_path / "hf" / "config.json").read_bytes() == (source / "config.json").read_bytes()
    assert_bitwise(hf_tensors(source), hf_tensors(tmp_path / "hf"))
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) == 3
    for name in ("generation_config.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "hf" / name).read_bytes() == (source / name).read_bytes()
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path / "hf")(PROMPT).input_ids == prompt_ids(
        HFCheckpoint.open(source).tokenizer)[0].tolist()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_trained_checkpoint_round_trip_dtmega_hf_dtmega_is_bitwise(tiny_checkpoint, tmp_path):
    """A checkpoint trained by `dtmega train` -> HF -> dtmega: every weight bitwise; and
    transformers computes the trained model's logits from the export."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from dtmega.interop.hf_export import export_hf
    from dtmega.interop.hf_import import import_hf
    from dtmega.train.checkpoint import resolve_checkpoint

    export_hf(tiny_checkpoint, tmp_path / "hf")
    # the run's byte tokenizer goes out as a byte-level BPE without merges: the same ids
    exported = HFCheckpoint.open(tmp_path / "hf").tokenizer
    text = "In the beginning, héllo ✓"
    assert exported.encode(text) == list(text.encode("utf-8")) and exported.decode(exported.encode(text)) == text
    back = import_hf(tmp_path / "hf", tmp_path / "back")

    def weights(path: Path) -> dict[str, torch.Tensor]:
        metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        state = {"model": {k.removeprefix("model."): torch.empty(m.size) for k, m in metadata.items()
                           if k.startswith("model.") and hasattr(m, "size")}}
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
        return state["model"]

    assert_bitwise(weights(resolve_checkpoint(tiny_checkpoint)), weights(back))
    pm, _, _ = restore(tiny_checkpoint)
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = pm.module(ids)
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()(ids).logits
    assert relative_max(ours, theirs) < LOGITS_RTOL


@pytest.mark.parametrize("save", [save_tiny_llama31, save_tiny_mixtral], ids=["llama31_rope_scaling_gqa", "mixtral"])
def test_transformers_made_models_load_with_logits_parity_and_round_trip(save, tmp_path):
    """Llama-3.1 RoPE scaling + GQA + untied output (five shards), and Mixtral's experts and
    router: dtmega's logits equal transformers'; HF -> dtmega -> HF is bitwise."""
    from transformers import AutoModelForCausalLM

    from dtmega.interop.hf_export import export_hf
    from dtmega.interop.hf_import import import_hf

    directory = save(tmp_path / "hf")
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()(ids).logits
        ours = loaded_unsharded(directory)(ids)
    assert relative_max(ours, theirs) < LOGITS_RTOL
    export_hf(import_hf(directory, tmp_path / "ckpt"), tmp_path / "back")
    assert_bitwise(hf_tensors(directory), hf_tensors(tmp_path / "back"))
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads((directory / "config.json").read_text())


def test_generate_and_evaluate_accept_load_hf(capsys, tmp_path):
    """The commands take a Hugging Face directory directly (`--load-hf`, no conversion)."""
    directory = save_tiny_llama31(tmp_path / "hf")
    assert dtmega_main(["generate", "--load-hf", str(directory), "--prompt", "In the beginning", "--greedy",
                        "--max-new-tokens", "4"]) == 0
    assert "In the beginning" in capsys.readouterr().out
    (tmp_path / "lambada.jsonl").write_text(json.dumps({"text": "the cat sat on the mat"}) + "\n")
    assert dtmega_main(["evaluate", "--load-hf", str(directory), "--task", "lambada",
                        "--valid-data", str(tmp_path / "lambada.jsonl")]) == 0
    assert "lambada" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # one source of weights, not two
        dtmega_main(["generate", "--load", "x", "--load-hf", str(directory), "--prompt", "a"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_evaluate_takes_one_length_rule_for_load_hf_and_load(capsys, tmp_path):
    """A Hugging Face model records only its context (max_position_embeddings, 256 here): that is
    the default sample length for --load-hf and for the checkpoint `convert hf-to-dtmega` makes
    of it (the same windows, the same loss); a dtmega run's checkpoint uses the run's
    --seq-length. Each says which in a note."""
    from dtmega.data.preprocess import PreprocessConfig, preprocess
    from tests.corpus import make_texts, write_jsonl

    directory = save_tiny_llama31(tmp_path / "hf")
    write_jsonl(tmp_path / "held.jsonl", make_texts(60, seed=9))
    preprocess(PreprocessConfig(input=tmp_path / "held.jsonl", output_prefix=str(tmp_path / "held"),
                                tokenizer=TokenizerSpec("HuggingFaceTokenizer", str(directory)), append_eod=True,
                                progress=False))
    data = ["--data-path", str(tmp_path / "held_text_document"), "--eval-iters", "1", "--micro-batch-size", "1"]
    assert dtmega_main(["evaluate", "--load-hf", str(directory), *data]) == 0
    direct = capsys.readouterr().out
    assert dtmega_main(["convert", "hf-to-dtmega", "--hf-dir", str(directory), "--save", str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    assert dtmega_main(["evaluate", "--load", str(tmp_path / "ckpt"), *data]) == 0
    converted = capsys.readouterr().out
    for out in (direct, converted):
        assert "samples of 256 tokens (the Hugging Face model's context, max_position_embeddings" in out, out
    loss = [line.split("loss ")[1].split(",")[0] for line in (direct, converted) for line in line.splitlines()
            if " tokens: loss " in line]
    assert len(loss) == 2 and loss[0] == loss[1]


# ---- tokenizers in every form Megatron users pass --------------------------------------------

@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory) -> Path:
    """A 200-piece SentencePiece BPE model trained on the test corpus (a Llama-2-style file)."""
    import sentencepiece

    from tests.corpus import make_texts

    root = tmp_path_factory.mktemp("spm")
    (root / "text.txt").write_text("\n".join(make_texts(80, seed=4)))
    sentencepiece.SentencePieceTrainer.train(input=str(root / "text.txt"), model_prefix=str(root / "tokenizer"),
                                             vocab_size=200, model_type="bpe", minloglevel=2)
    return root / "tokenizer.model"


def test_tokenizer_model_takes_json_directory_and_sentencepiece(sentencepiece_model, tmp_path):
    import sentencepiece

    directory = smollm2_dir()
    by_file = build_tokenizer(TokenizerSpec("HuggingFaceTokenizer", str(directory / "tokenizer.json")))
    by_dir = build_tokenizer(TokenizerSpec("HuggingFaceTokenizer", str(directory)))
    assert by_file.encode(PROMPT) == by_dir.encode(PROMPT) == [504, 3575, 282, 4649, 314]
    spm = build_tokenizer(TokenizerSpec("HuggingFaceTokenizer", str(sentencepiece_model)))
    assert isinstance(spm, SentencePieceTokenizer) and spm.vocab_size == 200 and spm.eod_token == "</s>"
    text = "And the evening and the morning were the first day."
    reference = sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_model))
    assert spm.encode(text) == reference.encode(text) and spm.decode(spm.encode(text)) == text
    copy = tokenizer_from_json(spm.to_json())  # how a checkpoint carries it
    assert copy.encode(text) == spm.encode(text) and copy.eod == spm.eod
    shutil.copy(sentencepiece_model, tmp_path / "tokenizer.model")  # a directory holding a tokenizer.model
    assert build_tokenizer(TokenizerSpec("HuggingFaceTokenizer", str(tmp_path))).encode(text) == spm.encode(text)


def test_preprocess_with_a_sentencepiece_model(sentencepiece_model, tmp_path):
    from dtmega.data.indexed import IndexedDataset

    text = "In the beginning God created the heaven and the earth."
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": text}) + "\n")
    assert dtmega_main(["preprocess", "--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "d"),
                        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(sentencepiece_model),
                        "--append-eod", "--workers", "1"]) == 0
    spm = build_tokenizer(TokenizerSpec("HuggingFaceTokenizer", str(sentencepiece_model)))
    assert IndexedDataset(str(tmp_path / "d_text_document"))[0].tolist() == spm.encode(text) + [spm.eod]


# ---- bad inputs: a clear error before any weight is read -------------------------------------

def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _missing_shard(d: Path) -> None:
    (d / "model-00003-of-00005.safetensors").unlink()


def _unsupported_architecture(d: Path) -> None:
    _edit_json(d / "config.json", architectures=["GPTNeoXForCausalLM"])


def _attention_bias(d: Path) -> None:
    _edit_json(d / "config.json", attention_bias=True)


def _shape_disagrees(d: Path) -> None:
    _edit_json(d / "config.json", intermediate_size=128)


def _tokenizer_too_large(d: Path) -> None:
    _edit_json(d / "config.json", vocab_size=200)


def _other_rope(d: Path) -> None:
    _edit_json(d / "config.json", rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0})


def _index_names_a_tensor_twice_wrong(d: Path) -> None:
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00005.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def _truncated_shard(d: Path) -> None:  # matrix-2 N24
    shard = d / "model-00001-of-00005.safetensors"
    shard.write_bytes(shard.read_bytes()[:-5000])


BAD = {
    "truncated_shard": (_truncated_shard, "model-00001-of-00005.safetensors is not a readable safetensors file"),
    "missing_shard": (_missing_shard, "names shards that are not in .*model-00003-of-00005.safetensors"),
    "unsupported_architecture": (_unsupported_architecture, "architectures = \\['GPTNeoXForCausalLM'\\] is not supported"),
    "attention_bias": (_attention_bias, "attention_bias = True is not supported"),
    "shape_disagrees": (_shape_disagrees, "mlp.gate_proj.weight: \\[96, 64\\] in .*the config gives \\[128, 64\\]"),
    "tokenizer_larger_than_embedding": (_tokenizer_too_large, "tokenizer .* has 300 tokens but the model's embedding only 200"),
    "rope_type": (_other_rope, "rope_parameters.rope_type = 'yarn' is not supported"),
    "index_points_at_the_wrong_shard": (_index_names_a_tensor_twice_wrong, "the index puts model.norm.weight in"),
}


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return save_tiny_llama31(tmp_path_factory.mktemp("tiny_llama") / "hf")


@pytest.mark.parametrize("case", list(BAD))
def test_bad_hugging_face_checkpoints_are_refused_with_the_fix(case, tiny_llama_dir, tmp_path, capsys):
    directory = tmp_path / "hf"
    shutil.copytree(tiny_llama_dir, directory)
    damage, message = BAD[case]
    damage(directory)
    with pytest.raises(HFFormatError, match=message):  # a directory without a tokenizer converts: test_convert_weights_only.py
        HFCheckpoint.open(directory)
    assert dtmega_main(["convert", "hf-to-dtmega", "--hf-dir", str(directory), "--save", str(tmp_path / "c")]) == 2
    assert not (tmp_path / "c").exists()  # refused before anything was written
    assert "dtmega convert:" in capsys.readouterr().err


def test_export_refuses_a_directory_that_holds_files(tiny_checkpoint, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(HFFormatError, match="exists and is not empty; nothing was written"):
        from dtmega.interop.hf_export import export_hf

        export_hf(tiny_checkpoint, tmp_path / "out")
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


def test_the_docs_name_table_is_the_mapping_the_code_uses():
    from dtmega.models.llama.hf_names import NAME_TABLE

    page = (Path(__file__).resolve().parents[2] / "docs" / "checkpoints.md").read_text()
    for ours, theirs in NAME_TABLE:
        assert f"| `{ours}` | `{theirs}`" in page, (ours, theirs)


def test_train_load_hf_is_checked_before_launch(tiny_llama_dir, tmp_path, capsys):
    """`dtmega train --load-hf`: the model's sizes come from config.json, --save-hf needs --save,
    and a dry run plans the HF model (its tokenizer, its vocabulary) for 4 ranks."""
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in ["In the beginning"] * 50) + "\n")
    assert dtmega_main(["preprocess", "--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(tmp_path / "d"),
                        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tiny_llama_dir),
                        "--append-eod", "--workers", "1"]) == 0
    base = ["train", "--load-hf", str(tiny_llama_dir), "--data-path", str(tmp_path / "d_text_document"),
            "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "2",
            "--lr", "1e-4"]
    assert dtmega_main([*base, "--num-layers", "4", "--dry-run", "1"]) == 2
    assert "sizes come from its config.json; --num-layers cannot change them" in capsys.readouterr().err
    assert dtmega_main([*base, "--save-hf", str(tmp_path / "out"), "--dry-run", "1"]) == 2
    assert "--save-hf writes the run's final checkpoint as a Hugging Face model: it needs --save" in capsys.readouterr().err
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert dtmega_main([*base, "--save", str(tmp_path / "s"), "--save-hf", str(tmp_path / "out"), "--dry-run", "1"]) == 2
    assert "holds files; the export never overwrites" in capsys.readouterr().err
    assert dtmega_main([*base, "--tensor-model-parallel-size", "2", "--dry-run", "4"]) == 0
    printed = capsys.readouterr().out
    assert "tp=2" in printed, printed[-2000:]
