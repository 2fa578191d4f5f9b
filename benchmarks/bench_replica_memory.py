"""A CPU replica's memory over weight pushes, with and without handing freed buffers back, side by side.

verl's CPU mode pushes the actor's whole state to each replica's Ray actor every step; the actor
unpickles it into fresh buffers, copies them into the served model and frees them. glibc keeps freed
buffers in its heaps, so the actor's RSS grows; ``agl_backend_verl.cpu.replica.release_freed_memory``
(``malloc_trim``) hands them back after each push. Each side is a Ray actor holding a state of
``--params`` million float32 parameters in matrices of a SmolLM2-135M layer's shape, fed ``--pushes``
fresh states; it prints the actor's RSS after each push.

    python benchmarks/bench_replica_memory.py                  # 135M parameters, 8 pushes
    python benchmarks/bench_replica_memory.py --params 40 --pushes 4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import psutil
import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agl_backend_verl.cpu.replica import release_freed_memory  # noqa: E402

SHAPE = (576, 1536)  # one of SmolLM2-135M's MLP matrices


@ray.remote(num_cpus=0)
class Replica:
    """Holds a state and copies each pushed state into it, as the replica's server loads weights."""

    def __init__(self, n_matrices: int, release: bool):
        self.state = {f"w{i}": torch.zeros(SHAPE) for i in range(n_matrices)}
        self.release = release

    def load(self, state: dict[str, torch.Tensor]) -> float:
        with torch.no_grad():
            for name, tensor in state.items():
                self.state[name].copy_(tensor)
        if self.release:
            release_freed_memory()
        return psutil.Process().memory_info().rss / 2**20


def side(release: bool, n_matrices: int, pushes: int) -> list[float]:
    replica = Replica.remote(n_matrices, release)
    rss = []
    for _ in range(pushes):
        rss.append(ray.get(replica.load.remote({f"w{i}": torch.randn(SHAPE) for i in range(n_matrices)})))
    ray.kill(replica)
    return rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=135.0, help="millions of parameters pushed")
    parser.add_argument("--pushes", type=int, default=8)
    args = parser.parse_args()
    n_matrices = max(1, round(args.params * 1e6 / (SHAPE[0] * SHAPE[1])))
    ray.init(num_cpus=1, include_dashboard=False)
    try:
        kept, released = side(False, n_matrices, args.pushes), side(True, n_matrices, args.pushes)
    finally:
        ray.shutdown()
    print(f"{n_matrices} matrices of {SHAPE} ({n_matrices * SHAPE[0] * SHAPE[1] / 1e6:.0f} M parameters)")
    print("push  RSS MiB, freed buffers kept  RSS MiB, released  ratio")
    for i, (a, b) in enumerate(zip(kept, released), 1):
        print(f"{i:4d}  {a:26.0f}  {b:17.0f}  {a / b:5.2f}")
    growth = kept[-1] - kept[0], released[-1] - released[0]
    print("growth after the first push: kept {:.0f} MiB, released {:.0f} MiB".format(*growth))


if __name__ == "__main__":
    main()
