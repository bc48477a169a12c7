"""The README's Python code runs as written on a CPU, top to bottom, in one namespace.

One substitution: the line that picks the bundled SmolLM2 (``path = smollm2_bf16_dir()``; encoding its 106 M weights
takes minutes on this machine) picks a tiny random Llama instead. Blocks that need vLLM are left to the vLLM tests.
Truth: the code runs, and what it says it leaves behind is there (the checkpoint with its tokenizer, loadable).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

README = Path(__file__).resolve().parents[1] / "README.md"
SMOLLM2_LINE = "path = smollm2_bf16_dir()"


def python_blocks() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    return [b for b in blocks if "vllm" not in b]


def test_the_readme_names_the_model_it_loads():
    blocks = python_blocks()
    assert len(blocks) >= 3
    assert sum(SMOLLM2_LINE in b for b in blocks) == 1, "the library snippet defines its own `path`"


def test_the_readme_python_runs_as_written(tmp_path, monkeypatch, capsys):
    from tiny_models import tiny_llama

    tiny = tiny_llama(tmp_path / "tiny-llama", layers=2)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    namespace: dict = {"__name__": "__readme__"}
    for i, block in enumerate(python_blocks()):
        code = block.replace(SMOLLM2_LINE, f"path = {str(tiny)!r}")
        exec(compile(code, f"README.md python block {i + 1}", "exec"), namespace)
    out = capsys.readouterr().out
    assert "hits" in out and "misses" in out          # the summary the snippet prints
    ckpt = work / "model-exl3"
    assert (ckpt / "config.json").is_file() and (ckpt / "tokenizer.json").is_file()
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(ckpt))           # `exl3rt generate --model model-exl3` needs it
