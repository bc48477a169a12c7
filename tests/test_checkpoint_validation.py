"""One validation of EXL3 checkpoints (format/validate.py), shared by every loader and by ``exl3rt inspect``.

Each case is a small crafted copy of a tiny EXL3 checkpoint with one defect (a relabelled dtype, a tensor in two
shards, a config.json that does not describe the weights, a NaN, a missing config.json, two sets of weight files).
Truth: the crafted file itself; every entry point refuses it with one line naming the tensor or file,
``exl3rt inspect`` / ``inspect --validate`` / ``generate --model`` with status 1, ``from_pretrained`` with a
FormatError, and the directory is byte for byte as it was. Where the check must come before the model is built, the
model class's constructor fails the test if it is reached.
"""

from __future__ import annotations

import ast
import json
import shutil
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from exl3rt.format.checkpoint import Exl3Checkpoint
from exl3rt.format.errors import FormatError
from exl3rt.format.validate import check_values, validate_checkpoint
from exl3rt.util.tensorfiles import INDEX_NAME, TensorFileError, TensorFiles
from test_cli_errors import assert_error_line, run, snapshot

pytest.importorskip("transformers")

Q = "model.layers.0.self_attn.q_proj"
SHARD = "model-00001-of-00001.safetensors"
PROMPT = ["--prompt", "the quick", "--max-new-tokens", "1", "--quiet"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A 2-layer Llama EXL3 checkpoint (random codes, all three codebooks) with a tokenizer: loads in a second."""
    from exl3rt.cli.example import write_example_checkpoint
    from tiny_models import save_tokenizer

    path = tmp_path_factory.mktemp("valid") / "base"
    write_example_checkpoint(path, hidden=128, intermediate=200, layers=2, vocab=64)
    save_tokenizer(path)
    return path


# ---- crafting -----------------------------------------------------------------------------------------------

def _tensors(d: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Rewrite the checkpoint's one shard with ``edit`` applied to its tensors (the index still names them all)."""
    tensors = load_file(str(d / SHARD))
    edit(tensors)
    save_file(tensors, str(d / SHARD), metadata={"format": "pt"})


def _config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def trellis_labelled_f16(d: Path) -> None:
    """The int16 codes' bytes as they are, labelled F16 in the header."""
    _tensors(d, lambda t: t.update({f"{Q}.trellis": t[f"{Q}.trellis"].view(torch.float16)}))


def suh_f32(d: Path) -> None:
    _tensors(d, lambda t: t.update({f"{Q}.suh": t[f"{Q}.suh"].float()}))


def suh_short(d: Path) -> None:
    _tensors(d, lambda t: t.update({f"{Q}.suh": t[f"{Q}.suh"][:64].clone()}))


def two_copies(d: Path) -> None:
    """Two shards; the second also holds a different model.norm.weight and q_proj trellis, which the index places in
    the first (transformers and vLLM load every tensor of every shard: they would read either copy)."""
    tensors = load_file(str(d / SHARD))
    (d / SHARD).unlink()
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    head = {n: t for n, t in tensors.items() if n.startswith("lm_head.")}
    rest = {n: t for n, t in tensors.items() if n not in head}
    stale = {"model.norm.weight": torch.full_like(tensors["model.norm.weight"], 3.0),
             f"{Q}.trellis": torch.randint(-32768, 32768, tensors[f"{Q}.trellis"].shape, dtype=torch.int16)}
    save_file(rest, str(d / first), metadata={"format": "pt"})
    save_file({**head, **stale}, str(d / second), metadata={"format": "pt"})
    wmap = {**{n: first for n in rest}, **{n: second for n in head}}
    (d / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": wmap}))


def nan_embedding(d: Path) -> None:
    def edit(t):
        t["model.embed_tokens.weight"][3, 5] = float("nan")
    _tensors(d, edit)


def embedding_too_large(d: Path) -> None:
    _tensors(d, lambda t: t.update({"model.embed_tokens.weight": torch.zeros(256, 128, dtype=torch.float16)}))


def norm_wrong_width(d: Path) -> None:
    """A tensor config.json does not cover: only the model transformers builds (on meta) knows its shape."""
    _tensors(d, lambda t: t.update({"model.norm.weight": torch.ones(96, dtype=torch.float16)}))


def no_config(d: Path) -> None:
    (d / "config.json").unlink()


def single_file_beside_the_index(d: Path) -> None:
    shutil.copy(d / SHARD, d / "model.safetensors")


def config_names_other_weights(d: Path) -> None:
    shutil.copy(d / SHARD, d / "other.safetensors")
    _config(d, transformers_weights="other.safetensors")


LAYERS = r"config.json: num_hidden_layers=100000, but \S+ stores 2 layer\(s\) \(model.layers.0 to model.layers.1\)"
# name -> (how the copy is spoiled, the error's pattern, whether plain `inspect` (headers and config only) finds it)
CASES: dict[str, tuple[Callable[[Path], None], str, bool]] = {
    "trellis labelled F16": (trellis_labelled_f16, rf"{Q}.trellis: stored as F16 in \S+{SHARD}, but EXL3 stores it as "
                                                   r"I16", True),
    "suh F32": (suh_f32, rf"{Q}.suh: stored as F32 in \S+, but EXL3 stores it as F16", True),
    "suh shape": (suh_short, rf"{Q}.suh: shape \[64\] in \S+, but the trellis \[8, 8, 64\] makes it \[128\]", True),
    "tensor in two shards": (two_copies, rf"{Q}.trellis: stored twice, in \S+model-00001-of-00002.safetensors and in "
                                         rf"\S+model-00002-of-00002.safetensors \({INDEX_NAME} names "
                                         rf"model-00001-of-00002.safetensors\)", True),
    "100000 layers": (lambda d: _config(d, num_hidden_layers=100000), LAYERS, True),
    "no attention heads": (lambda d: _config(d, num_attention_heads=0),
                           r"config.json: num_attention_heads=0 is not a positive integer", True),
    "no kv heads (text_config)": (lambda d: _config(d, num_key_value_heads=None,
                                                    text_config={"num_key_value_heads": 0}),
                                  r"config.json: text_config.num_key_value_heads=0 is not a positive integer", True),
    "hidden size a string": (lambda d: _config(d, hidden_size="128"),
                             r"config.json: hidden_size='128' is not a positive integer", True),
    "quantization_config a list": (lambda d: _config(d, quantization_config=[{"quant_method": "exl3"}]),
                                   r"config.json: quantization_config is a JSON list, not an object", True),
    "embedding against config": (embedding_too_large, r"model.embed_tokens.weight: shape \[256, 128\] in \S+, but "
                                                      r"config.json's vocab_size is 64", True),
    "NaN embedding": (nan_embedding, r"model.embed_tokens.weight: non-finite values \(NaN/inf\) in \S+, the first at "
                                     r"index \[3, 5\]", False),
    "model.safetensors beside the index": (single_file_beside_the_index, r"holds both model.safetensors and "
                                                                         rf"{INDEX_NAME}, which names other shards",
                                           True),
    "transformers_weights elsewhere": (config_names_other_weights, r"config.json: transformers_weights names "
                                                                   r"'other.safetensors', but the checkpoint's weights "
                                                                   rf"are read from {INDEX_NAME}", True),
}


#: config.json values transformers' own config parsing fails on (ZeroDivisionError, AttributeError, TypeError)
#: before a quantizer exists: from_pretrained raises that error; the CLI's entry points give exl3rt's line
PARSED_BY_TRANSFORMERS = {"no attention heads", "hidden size a string", "quantization_config a list"}


def spoiled(base: Path, tmp_path: Path, case: str) -> Path:
    path = tmp_path / case.replace(" ", "-").replace("(", "").replace(")", "")
    shutil.copytree(base, path)
    CASES[case][0](path)
    return path


@pytest.fixture
def no_model_built(monkeypatch):
    """The checks come before transformers builds a model from config.json: building one fails the test."""
    from transformers import LlamaForCausalLM

    def never(*a, **k):
        raise AssertionError("a model was built from a config.json that should have been refused before")

    monkeypatch.setattr(LlamaForCausalLM, "__init__", never)


def _from_pretrained(path: Path):
    import exl3rt.integrations.transformers  # noqa: F401  (registers quant_method "exl3")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


# ---- every entry point refuses every case ---------------------------------------------------------------------

def test_the_untouched_checkpoint_loads_everywhere(base, capsys):
    """The control: what every case below spoils passes every check as written."""
    assert validate_checkpoint(base, data=True).config is not None
    rc, out, _ = run(capsys, ["inspect", "--validate", str(base)])
    assert rc == 0 and "validated" in out
    rc, out, _ = run(capsys, ["generate", "--model", str(base), *PROMPT])
    assert rc == 0 and "generated 1 tokens" in out
    assert _from_pretrained(base) is not None


@pytest.mark.parametrize("case", list(CASES))
def test_every_entry_point_refuses_it_in_one_line_before_building_a_model(case, base, tmp_path, capsys,
                                                                          no_model_built):
    _, pattern, header_level = CASES[case]
    path = spoiled(base, tmp_path, case)
    before = snapshot(path)
    t0 = time.perf_counter()
    argvs = [["inspect", "--validate", str(path)], ["generate", "--model", str(path), *PROMPT]]
    if header_level:
        argvs.append(["inspect", str(path)])
    for argv in argvs:
        rc, _, err = run(capsys, argv)
        assert_error_line(rc, err, pattern)
    with pytest.raises(Exception if case in PARSED_BY_TRANSFORMERS else FormatError,
                       match=None if case in PARSED_BY_TRANSFORMERS else pattern):
        _from_pretrained(path)
    assert snapshot(path) == before
    assert time.perf_counter() - t0 < 30       # a refusal, not a 100000-layer model built and then refused


def test_plain_inspect_reads_no_values(base, tmp_path, capsys):
    """Without --validate inspect stays at headers and config.json: a NaN is only found with --validate."""
    path = spoiled(base, tmp_path, "NaN embedding")
    rc, out, _ = run(capsys, ["inspect", str(path)])
    assert rc == 0 and "validated" not in out


def test_a_tensor_config_json_does_not_cover_is_compared_with_the_model_on_meta(base, tmp_path, capsys):
    """model.norm.weight's width comes from the model transformers builds (on meta, no weight read): the loaders and
    inspect name it."""
    path = tmp_path / "norm"
    shutil.copytree(base, path)
    norm_wrong_width(path)
    before = snapshot(path)
    pattern = (r"model.norm.weight: shape \[96\] in \S+, but the model config.json describes \(LlamaForCausalLM\) "
               r"has \[128\]")
    for argv in (["inspect", str(path)], ["inspect", "--validate", str(path)],
                 ["generate", "--model", str(path), *PROMPT]):
        rc, _, err = run(capsys, argv)
        assert_error_line(rc, err, pattern)
    with pytest.raises(FormatError, match=pattern):
        _from_pretrained(path)
    assert snapshot(path) == before


def test_a_save_killed_before_config_json(base, tmp_path, capsys):
    """exl3rt writes config.json last: without it --validate and every loader refuse the directory; plain inspect
    still lists the tensors and says that nothing can load them."""
    path = tmp_path / "killed"
    shutil.copytree(base, path)
    no_config(path)
    before = snapshot(path)
    rc, _, err = run(capsys, ["inspect", "--validate", str(path)])
    assert_error_line(rc, err, r"killed: no config.json, so not a complete checkpoint .*rerun the save or quantize")
    rc, _, err = run(capsys, ["generate", "--model", str(path), *PROMPT])
    assert_error_line(rc, err, r"killed: not a Hugging Face model directory \(no config.json\)")
    with pytest.raises((OSError, ValueError)):     # transformers' own refusal of a directory without config.json
        _from_pretrained(path)
    rc, out, _ = run(capsys, ["inspect", str(path)])
    assert rc == 0 and out.startswith("note ") and "not a complete checkpoint" in out and Q in out
    rc, out, _ = run(capsys, ["inspect", "--json", str(path)])
    assert rc == 0 and "not a complete checkpoint" in json.loads(out)["note"]
    assert snapshot(path) == before


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from tiny_models import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("valid") / "tiny", layers=1)


def test_an_unquantized_model_gets_the_config_checks_before_online_quantization(tiny, tmp_path, capsys,
                                                                                no_model_built):
    src = tiny
    for changes, pattern in (({"num_hidden_layers": 100000}, r"num_hidden_layers=100000, but \S+ stores 1 layer"),
                             ({"num_attention_heads": 0}, r"num_attention_heads=0 is not a positive integer"),
                             ({"quantization_config": ["exl3"]}, r"quantization_config is a JSON list")):
        path = tmp_path / f"m{len(pattern)}"
        shutil.copytree(src, path)
        _config(path, **changes)
        rc, _, err = run(capsys, ["generate", "--model", str(path), "--bits", "2", "--cache-dir",
                                  str(tmp_path / "c"), *PROMPT])
        assert_error_line(rc, err, pattern)
    assert not (tmp_path / "c").exists()


# ---- the shared checks themselves ------------------------------------------------------------------------------

def test_exllamav3_checkpoints_pass_every_check():
    """Checkpoints exllamav3's own converter made: the checks are no stricter than real checkpoints."""
    data = Path(__file__).resolve().parent / "data" / "exllamav3"
    for name in ("llama_mul1", "llama_3inst", "qwen3moe_mcg"):
        assert validate_checkpoint(data / name, data=True).linears()


def test_the_value_scan_reads_in_slices_and_names_the_first_bad_element(base, tmp_path):
    path = spoiled(base, tmp_path, "NaN embedding")
    files = TensorFiles(path)
    assert [tuple(c.shape) for c in files.chunks("model.embed_tokens.weight", 1024)] == [(4, 128)] * 16
    for max_bytes in (256, 1024, 1 << 20):       # one row, four rows, all at once
        with pytest.raises(FormatError, match=r"the first at index \[3, 5\]"):
            check_values(files, max_bytes=max_bytes)
    check_values(TensorFiles(base), max_bytes=256)


@pytest.mark.parametrize("case", ["large finite", "inf", "+inf and -inf", "nan"])
def test_the_value_scan_against_an_elementwise_check(case, tmp_path):
    """Finite values near bf16's largest (whose sum would overflow) pass; an inf, a NaN, or infinities of both signs
    are named at their first index; truth: the tensor as built, element by element."""
    from safetensors.torch import save_file

    t = torch.ones(64, 8, dtype=torch.bfloat16)
    if case == "large finite":
        t.fill_(3.0e38)
    elif case == "inf":
        t[40, 2] = float("inf")
    elif case == "+inf and -inf":
        t[40, 2], t[50, 3] = float("inf"), float("-inf")
    else:
        t[40, 2] = float("nan")
    save_file({"w": t}, str(tmp_path / "model.safetensors"))
    files = TensorFiles(tmp_path)
    if case == "large finite":
        check_values(files, max_bytes=1024)
    else:
        with pytest.raises(FormatError, match=r"w: non-finite values .* the first at index \[40, 2\]"):
            check_values(files, max_bytes=1024)


def test_an_index_that_maps_everything_to_model_safetensors_is_one_set_of_files(base, tmp_path):
    path = tmp_path / "single"
    shutil.copytree(base, path)
    (path / SHARD).rename(path / "model.safetensors")
    index = json.loads((path / INDEX_NAME).read_text())
    index["weight_map"] = {n: "model.safetensors" for n in index["weight_map"]}
    (path / INDEX_NAME).write_text(json.dumps(index))
    assert Q in {li.name for li in validate_checkpoint(path, data=True).linears()}
    _config(path, transformers_weights=INDEX_NAME)      # names what is read: accepted
    validate_checkpoint(path, data=False)


def test_a_tensor_in_a_shard_the_index_does_not_name_it_in_is_still_read(base, tmp_path):
    """A tensor the index does not name at all is loaded by transformers from its file: it is listed (and checked)."""
    path = tmp_path / "extra"
    shutil.copytree(base, path)
    _tensors(path, lambda t: t.update({"model.extra.weight": torch.full((4,), float("inf"), dtype=torch.float16)}))
    assert "model.extra.weight" in TensorFiles(path)
    with pytest.raises(FormatError, match=r"model.extra.weight: non-finite values"):
        validate_checkpoint(path, data=True)


def test_a_duplicate_without_an_index_names_both_files(base, tmp_path):
    path = tmp_path / "noindex"
    shutil.copytree(base, path)
    (path / INDEX_NAME).unlink()
    save_file({"model.norm.weight": torch.ones(128, dtype=torch.float16)}, str(path / "zz.safetensors"))
    with pytest.raises(TensorFileError, match=rf"model.norm.weight: stored twice, in \S+{SHARD} and in "
                                              r"\S+zz.safetensors;"):
        TensorFiles(path)


def test_config_checks_without_a_model_or_its_files():
    from exl3rt.format.validate import check_config_values

    check_config_values({"num_hidden_layers": 2, "num_key_value_heads": None, "text_config": {"hidden_size": 64}},
                        "c.json")
    for cfg, pattern in (({"num_hidden_layers": True}, r"num_hidden_layers=True"),
                         ({"num_hidden_layers": [2]}, r"num_hidden_layers=\[2\]"),
                         ({"head_dim": -64}, r"head_dim=-64"),
                         ({"text_config": {"vocab_size": 0}}, r"text_config.vocab_size=0"),
                         ({"text_config": "llama"}, r"text_config is a JSON string")):
        with pytest.raises(FormatError, match=rf"^c.json: {pattern}"):
            check_config_values(cfg, "c.json")


def test_the_vllm_plugin_runs_the_shared_checks_in_checkpoint_mode(base, tmp_path):
    """vLLM is not installed here: its checkpoint mode's entry point (settings.validate_stored) is, and
    maybe_update_config calls it (read from the source)."""
    import exl3rt.integrations.vllm as plugin
    from exl3rt.integrations.vllm.settings import validate_stored

    validate_stored(base)
    validate_stored(tmp_path / "not-here")     # not a local directory: vLLM reads it from the Hub
    for case in ("trellis labelled F16", "tensor in two shards", "100000 layers", "NaN embedding"):
        with pytest.raises(FormatError, match=CASES[case][1]):
            validate_stored(spoiled(base, tmp_path, case))
    source = (Path(plugin.__file__).parent / "quant_config.py").read_text()
    fn = next(n for n in ast.walk(ast.parse(source))
              if isinstance(n, ast.FunctionDef) and n.name == "maybe_update_config")
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "validate_stored"]
    assert len(calls) == 2


def test_exl3_checkpoint_listing_checks_markers_and_half_bitrates(base, tmp_path):
    path = tmp_path / "marker"
    shutil.copytree(base, path)
    _tensors(path, lambda t: t.update({f"{Q}.mcg": torch.zeros(2, dtype=torch.int32)}))
    with pytest.raises(FormatError, match=rf"{Q}.mcg: shape \[2\] in \S+, but the trellis \[8, 8, 64\] makes it \[\]"):
        Exl3Checkpoint(path)
    half = tmp_path / "half"
    shutil.copytree(base, half)
    mlp = "model.layers.0.mlp.down_proj"      # K 2.5, mul1
    (half / INDEX_NAME).unlink()             # the shard alone: the index would miss the renamed marker
    _tensors(half, lambda t: t.update({f"{mlp}.mcg": t.pop(f"{mlp}.mul1")}))
    with pytest.raises(FormatError, match=rf"{mlp}.trellis: half-integer K = 2.5 .* needs the mul1 codebook"):
        Exl3Checkpoint(half)
