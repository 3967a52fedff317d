"""Model families of one's own, each a folder outside the dtmega package (loaded with
`--custom-import tests.families.<name>`), to show what adding a family takes."""
