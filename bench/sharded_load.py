"""Load time and host memory per rank: the whole-model load (then FSDP2) vs sharded loading.

    python bench/sharded_load.py --out runs/sharded_load.json            # world 2, ~370 MB bf16 file
    python bench/sharded_load.py --out runs/sl.json --world 4 --num-layers 8

Builds (once, under ``--model-dir``) a Wan transformer folder with random weights saved in bf16
(Wan2.1-1.3B's width, ``--num-layers`` blocks), then for each path spawns ``--world`` gloo
processes on the CPU that each load the expert and shard it with FSDP2 (full fine-tune, fp32
masters):

- ``whole``: ``from_pretrained`` in fp32 on every rank, then ``apply_fsdp`` (the old path);
- ``sharded``: ``build_skeleton`` on meta, ``apply_fsdp``, ``materialize`` (each rank reads its
  slices of the file).

Per rank: wall time of load + shard, peak anonymous memory (RssAnon sampled every 5 ms: the
process's own heap, not the file pages it maps) and peak RSS (VmHWM, file pages included).
Writes the numbers to ``--out`` (JSON) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class PeakAnon:
    """Samples the process's RssAnon in a thread; ``peak`` in bytes."""

    def __init__(self, every_s: float = 0.005):
        self.peak, self.every_s, self._stop = 0, every_s, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _status_kib("RssAnon") * 1024)
            time.sleep(self.every_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status_kib("RssAnon") * 1024)


def build_folder(root: Path, num_layers: int) -> Path:
    """A diffusers-style folder holding one random bf16 Wan transformer (model_index.json names it)."""
    from diffusers import WanTransformer3DModel

    folder = root / f"wan-{num_layers}l"
    if (folder / "transformer" / "diffusion_pytorch_model.safetensors").is_file():
        return folder
    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=12,
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=4096,
        freq_dim=256,
        ffn_dim=8960,
        num_layers=num_layers,
    ).to(torch.bfloat16)
    model.save_pretrained(folder / "transformer", max_shard_size="100GB")
    index = {"_class_name": "WanPipeline", "transformer": ["diffusers", "WanTransformer3DModel"]}
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


def _worker(rank, world, port, folder, path, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from diffusers import WanTransformer3DModel
    from torch.distributed.device_mesh import init_device_mesh

    from miles.models.sharded_load import WeightFiles, build_skeleton, materialize
    from miles.parallel.fsdp import apply_fsdp

    mesh = init_device_mesh("cpu", (world,))
    folder = Path(folder)
    dist.barrier()
    base_anon = _status_kib("RssAnon") * 1024  # torch, diffusers... before anything loads
    start = time.perf_counter()
    with PeakAnon() as anon:
        if path == "whole":
            model = WanTransformer3DModel.from_pretrained(folder / "transformer", torch_dtype=torch.float32)
            apply_fsdp(model, mesh)
        else:
            model = build_skeleton(folder, "transformer")
            apply_fsdp(model, mesh)
            materialize(model, torch.device("cpu"), WeightFiles(folder / "transformer"))
    seconds = time.perf_counter() - start
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    row = dict(
        path=path,
        rank=rank,
        seconds=seconds,
        base_anon_mib=base_anon / 2**20,
        peak_anon_mib=anon.peak / 2**20,
        peak_rss_mib=_status_kib("VmHWM") / 1024,
        local_shard_mib=local / 2**20,
    )
    Path(results, f"{path}{rank}.json").write_text(json.dumps(row))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file for the numbers")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--model-dir", default=".cache/bench-sharded-load")
    args = ap.parse_args()
    folder = build_folder(Path(args.model_dir), args.num_layers)
    file = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    rows = []
    with tempfile.TemporaryDirectory() as results:
        for path in ("whole", "sharded"):
            mp.spawn(_worker, args=(args.world, _free_port(), str(folder), path, results), nprocs=args.world)
        rows = [json.loads(p.read_text()) for p in sorted(Path(results).glob("*.json"))]
    report = dict(
        world=args.world, file_mib=file.stat().st_size / 2**20, num_layers=args.num_layers, rows=rows
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(
        f"bf16 file {report['file_mib']:.0f} MiB, world {args.world} (gloo, CPU, full fine-tune: fp32 masters)"
    )
    print(
        f"{'path':8} {'rank':>4} {'seconds':>8} {'anon before MiB':>16} {'peak anon MiB':>14} "
        f"{'peak RSS MiB':>13} {'local shard MiB':>16}"
    )
    for r in rows:
        print(
            f"{r['path']:8} {r['rank']:>4} {r['seconds']:>8.2f} {r['base_anon_mib']:>16.0f} {r['peak_anon_mib']:>14.0f} "
            f"{r['peak_rss_mib']:>13.0f} {r['local_shard_mib']:>16.0f}"
        )


if __name__ == "__main__":
    main()
