"""vLLM's OpenAI-compatible server (the CPU build) with the exl3rt plugin, asked over HTTP as a client would.

The server runs as its own process on 127.0.0.1 (a free port), once on a BF16 model encoded at load and once on an
EXL3 checkpoint from `exl3rt quantize`; completions (plain and streamed) and chat completions must give the same
greedy tokens as exl3rt's transformers path (float32, as the other end-to-end tests: bf16 kernels round differently
between vLLM and transformers). The tokens come back as ids (``return_tokens_as_token_ids``). The server is stopped
(its whole process group) whatever happens.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from tiny_models import tiny_llama  # noqa: E402

N = 8
PROMPT = [1, 5, 9, 12, 7, 20, 3]
CHAT_TEXT = "the quick brown fox jumps over"
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"   # the user's words, as they are


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` on ``model``; ``post`` asks it, ``stop`` ends it."""

    def __init__(self, model: Path, tmp: Path, cache: Path):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        template = tmp / "chat.jinja"
        template.write_text(TEMPLATE)
        env = dict(os.environ, EXL3RT_CACHE_DIR=str(cache), VLLM_CPU_KVCACHE_SPACE="1")
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", "tiny", "--quantization", "exl3", "--dtype", "float32", "--max-model-len", "128",
               "--enforce-eager", "--chat-template", str(template), "--host", "127.0.0.1", "--port", str(self.port)]
        self.log_path = tmp / f"server-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_ready(600)
        except BaseException:
            self.stop()
            raise

    def text(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def tail(self) -> str:
        return self.text()[-6000:]

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        raise AssertionError(f"the server did not answer /health within {timeout:.0f} s:\n{self.tail()}")

    def post(self, path: str, body: dict) -> dict | list:
        """The JSON answer; for ``stream`` requests the list of server-sent events' JSON payloads."""
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            if not body.get("stream"):
                return json.loads(r.read())
            events = []
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    events.append(json.loads(line[5:]))
            return events

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self.log.close()


def _ids(tokens: list) -> list[int]:
    """``token_id:N`` strings (``return_tokens_as_token_ids``) -> ints."""
    return [int(str(t).split(":", 1)[1]) for t in tokens]


def _greedy(model, ids: list[int]) -> list[int]:
    """N argmax steps, EOS a token like any other (what the server's ``ignore_eos`` does; ``generate``'s
    ``min_new_tokens`` would instead forbid EOS)."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(N):
            seq.append(int(model(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    return seq[len(ids):]


def _ask_and_check(server: Server, model, tokenizer) -> None:
    want = _greedy(model, PROMPT)
    assert len(set(want)) >= 3, f"degenerate continuation {want}: not a useful check"
    common = {"model": "tiny", "max_tokens": N, "temperature": 0, "ignore_eos": True, "return_tokens_as_token_ids": True}

    done = server.post("/v1/completions", {**common, "prompt": PROMPT, "logprobs": 1})
    choice = done["choices"][0]
    assert _ids(choice["logprobs"]["tokens"]) == want
    assert done["usage"]["completion_tokens"] == N

    events = server.post("/v1/completions", {**common, "prompt": PROMPT, "logprobs": 1, "stream": True})
    streamed = [t for e in events for c in e["choices"] if c.get("logprobs") for t in c["logprobs"]["tokens"]]
    assert _ids(streamed) == want and len(events) >= 2       # in pieces (a piece may hold several tokens)
    assert "".join(c.get("text", "") for e in events for c in e["choices"]) == choice["text"]

    chat_ids = tokenizer(CHAT_TEXT, add_special_tokens=False)["input_ids"]
    chat = server.post("/v1/chat/completions", {**common, "logprobs": True,
                                                "messages": [{"role": "user", "content": CHAT_TEXT}]})
    msg = chat["choices"][0]
    assert _ids([t["token"] for t in msg["logprobs"]["content"]]) == _greedy(model, chat_ids)
    assert msg["message"]["role"] == "assistant" and chat["usage"]["prompt_tokens"] == len(chat_ids)


@pytest.fixture(scope="module")
def f32_llama(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("m") / "llama", init_std=0.5)


def test_openai_server_online_matches_transformers(f32_llama, tmp_path):
    import exl3rt
    import exl3rt.integrations.transformers  # noqa: F401  (registers quant_method "exl3rt")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = tmp_path / "cache"
    server = Server(f32_llama, tmp_path, cache)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(f32_llama), dtype=torch.float32,
            quantization_config=exl3rt.Exl3Config(bits=4, cache_dir=str(cache), progress=False))
        assert model.hf_quantizer.summary()["misses"] == 0       # the server encoded and published every layer
        _ask_and_check(server, model, AutoTokenizer.from_pretrained(str(f32_llama)))
        # the load's progress, in the server's log: its last line says every planned weight was done
        assert re.search(r"exl3rt: online EXL3 encoding: (\S+)/\1 weights \(100\.0 %\).*done in", server.text())
    finally:
        server.stop()
    assert server.proc.returncode is not None


def test_openai_server_on_an_exl3_checkpoint_matches_transformers(f32_llama, tmp_path):
    import exl3rt.integrations.transformers  # noqa: F401  (registers quant_method "exl3")
    from exl3rt.cli.main import main
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = tmp_path / "exl3"
    assert main(["quantize", str(f32_llama), str(ckpt), "--bits", "4", "--cache-mode", "off", "--quiet"]) == 0
    server = Server(ckpt, tmp_path, tmp_path / "unused-cache")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
        _ask_and_check(server, model, AutoTokenizer.from_pretrained(str(ckpt)))
    finally:
        server.stop()
    assert not (tmp_path / "unused-cache").exists()
