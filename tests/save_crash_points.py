"""SIGKILL a ``save_exl3`` (what ``model.save_pretrained`` runs) at each of its write points, then check that the
next save into that directory sweeps what the killed one left and writes the same checkpoint.

The model is small and built without transformers (random EXL3 codes, a config object with ``to_dict``), so a
child starts in a fraction of a second; the write points are those of :class:`CheckpointWriter`, which every
save goes through. Events, numbered in order: ``mid-write FILE`` (a safetensors temporary half written),
``written FILE`` (a temporary complete, not yet renamed) and ``renamed FILE`` (just after an ``os.replace``).
"""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path
from typing import Optional

#: shards small enough that the model needs several, so a kill can fall between two of them
SHARD_BYTES = 40_000


class _Config:
    def to_dict(self) -> dict:
        return {"architectures": ["TinyForCausalLM"], "model_type": "tiny", "hidden_size": 128,
                "num_hidden_layers": 2, "vocab_size": 64}


def tiny_model():
    """Two layers of two EXL3 linears each, a norm and an embedding."""
    import torch
    from torch import nn

    from exl3rt.format.random import random_linear
    from exl3rt.runtime.linear import Exl3Linear

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.embed_tokens = nn.Embedding(64, 128)
            self.embed_tokens.weight.data = torch.randn(64, 128, generator=g)
            self.layers = nn.ModuleList()
            for i in range(2):
                layer = nn.Module()
                layer.up_proj = Exl3Linear.from_encoded(random_linear(128, 256, 3, seed=2 * i))
                layer.down_proj = Exl3Linear.from_encoded(random_linear(256, 128, 3, seed=2 * i + 1))
                layer.norm = nn.LayerNorm(128)
                self.layers.append(layer)
            self.config = _Config()

    return Tiny()


def child_main(out: str, kill_at: int, scratch: str) -> None:
    import exl3rt.format.checkpoint_write as cw
    from crash_points import numbered_write_points
    from exl3rt.runtime.export import save_exl3

    events, _ = numbered_write_points(kill_at, [cw])
    save_exl3(tiny_model(), out, max_shard_bytes=SHARD_BYTES, overwrite=True, progress=False,
              side_texts={"generation_config.json": '{"do_sample": false}\n'})
    Path(scratch, "events.json").write_text(json.dumps(events))


def run_child(out: Path, kill_at: Optional[int], scratch: Path) -> tuple[int, list[str]]:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["save_crash_points", "crash_points", "exl3rt.runtime.export", "exl3rt.format.random"])
    events_file = scratch / "events.json"
    events_file.unlink(missing_ok=True)
    proc = ctx.Process(target=child_main, args=(str(out), -1 if kill_at is None else kill_at, str(scratch)))
    proc.start()
    proc.join(300)
    return proc.exitcode, (json.loads(events_file.read_text()) if events_file.exists() else [])
