"""Completion detection against the real gateway: agl's terminal-cursor manager vs the naive strategy.

512 rollouts finish at random times over ~10 s (a simulated controller drives them on a real
``agl-server``). For each strategy, in the same run and against the same load, it reports HTTP
requests per completed rollout and completion pickup latency (terminal PATCH → the trainer has the
rollout's events), p50 and p90.

- agl: batched create, terminal-cursor polls with an adaptive interval, one events read and one
  delete per rollout (``agl_core.rollouts.gateway_sync``, default config).
- naive (Agent Lightning v1.0's manager): batched create, then every second one status GET per
  pending rollout, and for each finished one a raw and a triplet events GET and a delete.

Run: ``.venv/bin/python benchmarks/bench_gateway.py [--rollouts 512] [--spread 10]``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agl_core.config import load_config  # noqa: E402
from agl_core.plugins import PluginManager  # noqa: E402
from agl_core.rollouts.gateway_client import GatewayClient  # noqa: E402
from agl_core.rollouts.gateway_sync import GatewayRolloutSource  # noqa: E402
from agl_core.rollouts.source import make_requests  # noqa: E402
from tests.helpers.gateway_fixtures import Plan, SimulatedController  # noqa: E402
from tests.helpers.gateway_server import MODEL_NAME, GatewayServer  # noqa: E402

N_PER_GROUP = 4


def random_plans(spread: float, seed: int):
    rng = random.Random(seed)
    return lambda rollout: Plan(delay=rng.uniform(0.0, spread))


def run_agl(server: GatewayServer, n_rollouts: int, spread: float, seed: int) -> dict:
    config = load_config(
        overrides=[
            f"agentlightning.agl_base_url={server.url}",
            f"agentlightning.agl_key={server.key}",
            f"actor_rollout_ref.model.path={MODEL_NAME}",
            f"actor_rollout_ref.rollout.n={N_PER_GROUP}",
        ]
    )
    source = GatewayRolloutSource(config, PluginManager(load_entrypoints=False, builtins={}))
    samples = [{"i": i} for i in range(n_rollouts // N_PER_GROUP)]
    with SimulatedController(server, random_plans(spread, seed)) as controller:
        start = time.monotonic()
        batch = source.collect(samples, step=0, is_train=True)
        wall = time.monotonic() - start
    latencies = [r.ended_at - controller.finished_at[r.rollout_id] for r in batch.rollouts]
    requests = sum(source.client.requests_sent.values())
    source.close()
    return summary("agl (terminal cursor)", len(batch.rollouts), requests, latencies, wall, source.client.requests_sent)


def run_naive(server: GatewayServer, n_rollouts: int, spread: float, seed: int) -> dict:
    client = GatewayClient(server.url, server.key)
    plugins = PluginManager(load_entrypoints=False, builtins={})
    groups = make_requests(
        [{"i": i} for i in range(n_rollouts // N_PER_GROUP)],
        n=N_PER_GROUP,
        step=0,
        is_train=True,
        rollout_config={"timeout_seconds": 60},
        plugins=plugins,
    )
    requests = [r for g in groups for r in g]
    latencies, completed = [], 0
    with SimulatedController(server, random_plans(spread, seed)) as controller:
        start = time.monotonic()
        client.create_rollouts(requests)
        pending = {r.rollout_id for r in requests}
        while pending:
            for rid in list(pending):
                state = client.get_rollout(rid)["rollout"]["status"]["state"]
                if state in ("succeeded", "failed"):
                    client.get_events(rid)
                    client.get_events(rid, triplet=True)
                    latencies.append(time.time() - controller.finished_at[rid])
                    client.delete_rollout(rid)
                    pending.discard(rid)
                    completed += 1
            if pending:
                time.sleep(1.0)
        wall = time.monotonic() - start
    client.close()
    return summary(
        "naive (GET per pending per second)",
        completed,
        sum(client.requests_sent.values()),
        latencies,
        wall,
        client.requests_sent,
    )


def summary(name, completed, requests, latencies, wall, by_kind) -> dict:
    lat = np.asarray(latencies) * 1000.0
    return {
        "name": name,
        "completed": completed,
        "requests": requests,
        "per_rollout": requests / max(1, completed),
        "p50_ms": float(np.percentile(lat, 50)),
        "p90_ms": float(np.percentile(lat, 90)),
        "wall_s": wall,
        "by_kind": dict(by_kind),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=512)
    parser.add_argument("--spread", type=float, default=10.0, help="completion times spread over this many seconds")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with GatewayServer() as server:
        results = [
            run_agl(server, args.rollouts, args.spread, args.seed),
            run_naive(server, args.rollouts, args.spread, args.seed),
        ]
    print(f"{args.rollouts} rollouts finishing at random times over {args.spread:.0f} s, real agl-server\n")
    print(
        f"{'strategy':38} {'done':>5} {'HTTP req':>9} {'req/rollout':>12} {'pickup p50':>11} {'pickup p90':>11} "
        f"{'wall':>7}"
    )
    for r in results:
        print(
            f"{r['name']:38} {r['completed']:>5} {r['requests']:>9} {r['per_rollout']:>12.2f} "
            f"{r['p50_ms']:>9.1f}ms {r['p90_ms']:>9.1f}ms {r['wall_s']:>6.1f}s"
        )
    for r in results:
        print(f"  {r['name']}: requests by kind {r['by_kind']}")
    ours, naive = results
    print(
        f"\nnaive/agl: {naive['per_rollout'] / ours['per_rollout']:.1f}x requests per rollout, "
        f"{naive['p50_ms'] / ours['p50_ms']:.1f}x pickup p50, {naive['p90_ms'] / ours['p90_ms']:.1f}x pickup p90"
    )


if __name__ == "__main__":
    main()
