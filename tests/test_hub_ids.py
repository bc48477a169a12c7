"""``--model org/name``: a Hugging Face Hub ID resolves through the local Hugging Face cache (offline), and one that
is not there fails with a message that says so — no network is touched here."""

import shutil

import pytest

pytest.importorskip("huggingface_hub")

from exl3rt.cli._args import UsageError  # noqa: E402
from exl3rt.cli._load import model_dir  # noqa: E402

from tiny_models import tiny_llama  # noqa: E402


def fake_hub_cache(root, repo_id, src):
    """The layout huggingface_hub keeps: models--org--name/{refs/main, snapshots/<revision>/<files>}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    rev = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(src, repo / "snapshots" / rev)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    return repo / "snapshots" / rev


def test_a_hub_id_in_the_local_cache_resolves_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants as hc

    src = tiny_llama(tmp_path / "src")
    snap = fake_hub_cache(tmp_path / "hub", "someone/tiny-llama", src)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert model_dir("someone/tiny-llama") == snap
    with pytest.raises(UsageError, match="someone/missing: not a directory, and not in the local Hugging Face cache "
                                         r"\(HF_HUB_OFFLINE is set\)"):
        model_dir("someone/missing")
    # a path that is not a Hub ID keeps the plain message
    with pytest.raises(UsageError, match="no such directory"):
        model_dir(str(tmp_path / "nowhere"))


def test_a_hub_that_accepts_and_never_answers_is_one_line_within_30_s(tmp_path):
    """A local listener stands in for the Hub (HF_ENDPOINT): it accepts connections and never replies. Without
    deadlines `snapshot_download` waited forever (its first call, repo_info, has no timeout)."""
    import os
    import socket
    import subprocess
    import sys
    import threading
    import time

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held = []

    def accept():
        while True:
            try:
                held.append(srv.accept()[0])
            except OSError:
                return
    threading.Thread(target=accept, daemon=True).start()
    env = dict(os.environ, HF_ENDPOINT=f"http://127.0.0.1:{srv.getsockname()[1]}", HF_HOME=str(tmp_path / "hf"))
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("HF_HUB_ETAG_TIMEOUT", None)
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "exl3rt.cli.main", "generate", "--model", "org/name"], env=env,
                              capture_output=True, text=True, timeout=120)
    finally:
        srv.close()
    seconds = time.monotonic() - t0
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "did not answer within 5 s" in proc.stderr and "HF_HUB_ETAG_TIMEOUT" in proc.stderr, proc.stderr
    assert seconds < 30, seconds
    assert held, "the command never reached the listener"
