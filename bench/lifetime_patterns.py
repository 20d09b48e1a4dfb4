"""The places where miles hands C code a pointer whose owner could die, in a loop, heap checks on.

    python bench/lifetime_patterns.py --out runs/lifetime.json --iterations 2000 --check malloc

Issue 46's heap corruption (``malloc(): unaligned tcache chunk detected`` in one rank) was audited for
memory-lifetime defects. Beside the collectives (``bench/collective_audit.py``,
``bench/ring_collectives_stress.py``), these are the places where a buffer's address goes to C code
(numpy, safetensors, file writes) while Python may drop its owner:

- ``export_write``: ``miles.train.export.write_safetensors`` writes each tensor through
  ``t.contiguous().reshape(-1).view(torch.uint8).numpy().data`` — a memoryview of a numpy view of a
  temporary tensor, handed to ``file.write``; the tensors come from an iterator that drops them at
  once (non-contiguous, bf16, 0-d and empty ones included). The file is read back with safetensors'
  own loader and compared with the values;
- ``sharded_read``: ``miles.models.sharded_load.WeightFiles.read`` slices blocks out of a safetensors
  file through ``safe_open(...).get_slice``; the reader is closed, the file replaced by other bytes
  (as the tiny-model publish replaces a folder by rename), memory churned, and every block read
  before is compared with the original values (a block that viewed the closed mapping would change
  or fault);
- ``frombuffer``: ``torch.frombuffer(bytearray(...))`` over a temporary (``miles/rewards/world_i2v.py``),
  then viewed, permuted and converted; compared after churn;
- ``digest``: the checkpoint digest's ``t.view(torch.uint8).numpy().tobytes()`` on temporaries,
  against the bytes read through the tensor's storage (flattened first: ``contiguous()`` keeps a
  size-1 dimension's stride, e.g. (3, 1) with strides (1, 3), which ``view(torch.uint8)`` refuses —
  a state dict's gathered tensors never have one, so the digest itself is left as it is).

A thread allocates and frees tcache-sized tensors and bytes all along (the reward worker's part in
a run). ``--check`` re-runs this script in a child under glibc's checking allocator
(``malloc``: ``libc_malloc_debug.so`` + ``MALLOC_CHECK_=3`` + ``MALLOC_PERTURB_``), ``perturb``
(``MALLOC_PERTURB_`` on glibc's own allocator, tcache on) or ``none``. A use after free shows as a
wrong value (freed memory is garbled by ``MALLOC_PERTURB_``) or a heap-check abort (the child's exit
code). Writes ``--out`` (JSON): per pattern the iterations and wrong results, the child's exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))


def _churn(stop: threading.Event) -> None:
    import torch

    while not stop.is_set():
        blocks = [torch.empty(int(n)).fill_(1.0) for n in torch.randint(1, 250, (16,))]
        junk = [bytes(int(n)) for n in torch.randint(1, 1000, (16,))]
        del blocks, junk


def _tensors(gen, i: int):
    """A varied list of tensors: non-contiguous, bf16, 0-d, empty; sizes vary with ``i``."""
    import torch

    n = 1 + (i * 7) % 61
    return [
        torch.randn(n, 3, generator=gen).t(),  # non-contiguous
        torch.randn(n, generator=gen).to(torch.bfloat16),
        torch.tensor(float(i)),  # 0-d
        torch.empty(0, 4),
        torch.randint(0, 255, (n, 5), generator=gen, dtype=torch.uint8)[:, ::2],
    ]


def export_write(folder: Path, gen, i: int) -> int:
    from safetensors.torch import load_file

    from miles.train.export import write_safetensors

    expected = _tensors(gen, i)
    entries = [(f"t{k}", tuple(t.shape), t.dtype) for k, t in enumerate(expected)]
    path = folder / "export.safetensors"

    def fresh():  # each tensor a new temporary, dropped by the writer as soon as it is written
        for t in expected:
            yield t.clone() if t.is_contiguous() else t.contiguous().t().contiguous().t()

    write_safetensors(path, entries, fresh())
    got = load_file(str(path))
    return sum(not (got[f"t{k}"].equal(t.contiguous())) for k, t in enumerate(expected))


def sharded_read(folder: Path, gen, i: int) -> int:
    import torch
    from safetensors.torch import save_file

    from miles.models.sharded_load import WEIGHTS_NAME, WeightFiles

    full = {"a": torch.randn(37, 11, generator=gen), "b": torch.randn(64, generator=gen)}
    save_file(full, str(folder / WEIGHTS_NAME))
    files = WeightFiles(folder)
    row = i % 30
    blocks = {
        "a": files.read("a", (row, 2), (5, 7), (37, 11), "cpu"),
        "b": files.read("b", (i % 50,), (10,), (64,), "cpu"),
    }
    files.close()
    del files  # the reader and its safe_open handles are gone (reference counting frees them here)
    # replaced by other bytes, as a republished folder is (a new file renamed over the old one)
    tmp = folder / "replace.tmp"
    save_file({k: torch.full_like(v, -7.0) for k, v in full.items()}, str(tmp))
    os.replace(tmp, folder / WEIGHTS_NAME)
    _ = [torch.empty(1000).fill_(3.0) for _ in range(20)]
    want_a = full["a"][row : row + 5, 2:9]
    want_b = full["b"][i % 50 : i % 50 + 10]
    return int(not blocks["a"].equal(want_a)) + int(not blocks["b"].equal(want_b))


def frombuffer(folder: Path, gen, i: int) -> int:
    import torch

    h, w = 3 + i % 5, 4 + i % 7
    raw = torch.randint(0, 255, (h * w * 3,), generator=gen, dtype=torch.uint8)
    image = torch.frombuffer(bytearray(bytes(raw.numpy().tobytes())), dtype=torch.uint8)
    image = image.view(h, w, 3).permute(2, 0, 1).float() / 255
    _ = [bytearray(int(n)) for n in torch.randint(1, 500, (32,))]  # the freed bytearray's memory reused
    want = raw.view(h, w, 3).permute(2, 0, 1).float() / 255
    return int(not image.equal(want))


def digest(folder: Path, gen, i: int) -> int:
    import torch

    wrong = 0
    for t in _tensors(gen, i):
        c = t.detach().contiguous().cpu().reshape(-1)  # (checkpoint.py views without the reshape: see below)
        by_numpy = c.view(torch.uint8).numpy().tobytes() if c.numel() else b""
        by_storage = bytes(c.untyped_storage())[c.storage_offset() * c.element_size() :][: c.nbytes]
        wrong += by_numpy != by_storage
    return wrong


PATTERNS = {
    "export_write": export_write,
    "sharded_read": sharded_read,
    "frombuffer": frombuffer,
    "digest": digest,
}


def run_patterns(iterations: int, seed: int = 0) -> dict:
    import torch

    gen = torch.Generator().manual_seed(seed)
    stop = threading.Event()
    beside = threading.Thread(target=_churn, args=(stop,), daemon=True)
    beside.start()
    results = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name, fn in PATTERNS.items():
                folder = Path(tmp) / name
                folder.mkdir()
                t0 = time.perf_counter()
                wrong = sum(fn(folder, gen, i) for i in range(iterations))
                results[name] = {
                    "iterations": iterations,
                    "wrong": wrong,
                    "seconds": round(time.perf_counter() - t0, 1),
                }
    finally:
        stop.set()
        beside.join()
    return results


def main(argv: list[str] | None = None) -> int:
    import sp_stress  # noqa: E402  (bench scripts run as files)

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--iterations", type=int, default=2000)
    p.add_argument("--check", choices=("malloc", "perturb", "none"), default="malloc")
    p.add_argument("--perturb", type=int, default=165)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.out.write_text(json.dumps(run_patterns(args.iterations)) + "\n")
        return 0
    heap_env = sp_stress.check_env(args.check, args.perturb, args.out.with_suffix(""))
    child_out = args.out.with_suffix(".child.json")
    child_out.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **heap_env}
    cmd = [sys.executable, __file__, "--out", str(child_out), "--iterations", str(args.iterations), "--child"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    patterns = json.loads(child_out.read_text()) if proc.returncode == 0 and child_out.exists() else None
    result = {
        "check": args.check,
        "env": heap_env,
        "returncode": proc.returncode,
        "seconds": round(time.perf_counter() - t0, 1),
        "patterns": patterns,
        "wrong": None if patterns is None else sum(r["wrong"] for r in patterns.values()),
        "stderr_tail": proc.stderr[-2000:] if proc.returncode else "",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"[lifetime_patterns] {args.check}: rc {proc.returncode}, wrong {result['wrong']}, {result['seconds']} s"
    )
    return 0 if proc.returncode == 0 and result["wrong"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
