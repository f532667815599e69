"""Benchmark: a whole training step of each estimator on a 10^5–10^6-item catalog, unsharded and
sharded over ranks, as a ratio to the same two-tower trained with in-batch softmax.

    python integration/bench.py --out DIR          # runs every configuration, prints the table

Configurations: the unsharded retriever (plain ``EmbeddingCollection``, one process), and the
retriever row-wise sharded over W = 1 and 2 ranks (``torchrun``, gloo, one thread per rank), each
rank with B users per step. A step is: forward (one lookup), Gumbel top-K sampling from the whole
catalog, the loss, backward with the fused SGD. The in-batch-softmax step (what a TorchRec two-tower
trains with) looks up the B users and one positive item each and takes the cross-entropy of the
[B, B] scores. The ``*_sampled`` estimators (``--estimators capg_sampled capg_swr_sampled``) use the
retriever's sampled mode (only the listed rows are looked up): each rank lists two samples of
``--negatives`` uniform negatives of its own in one lookup, draws its users' candidates from the first
("sampling" then times the forward and the draw) and takes the loss on the catalog resampled with the
second, whose head is the candidates. Reported per rank:
median step time and sampling time alone, peak RSS, its growth over the process's footprint before
the model was built, and the bytes of item rows the rank holds. With ``--alternate`` every other step runs
with capg_rec's input checks off and is timed apart (``unchecked_step_s``): what the checks cost, measured in
the same processes (a run's steps on this kind of machine move by a quarter between runs).
Ratios are to the in-batch step of the same configuration. Results go to ``DIR/bench.json``/``.csv``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import _harness as h
    from torchrec import KeyedJaggedTensor

    import capg_rec
    from capg_rec import CAPGLoss, DrawnSample, UniformSampler, VPGLoss, sample_candidates

    k = args.candidates
    losses = {"vpg": lambda: VPGLoss(k), "vpg_swr": lambda: VPGLoss(k, with_replacement=True),
              "capg": lambda: CAPGLoss(k), "capg_plugin": lambda: CAPGLoss(k, method="plugin"),
              "capg_swr": lambda: CAPGLoss(k, method="with_replacement"),
              "capg_sampled": lambda: CAPGLoss(k), "capg_swr_sampled": lambda: CAPGLoss(k, method="with_replacement")}
    sampler = UniformSampler(args.negatives)

    sharded = args.mode == "sharded"
    rank, world = h.init() if sharded else (0, 1)
    torch.set_num_threads(1)
    setup = h.Setup(num_items=args.num_items, num_experts=1, dim=args.dim, num_users=10_000,
                    chunk_size=args.chunk_size)
    base_mb = _rss_mb()
    if sharded:
        model = h.shard(setup, lr=0.01)
        retriever = model.module
    else:
        model = retriever = h.build(setup)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    rows = int(retriever.catalog_ids().numel())
    loss_fn = None if args.estimator == "in_batch" else losses[args.estimator]()
    times, sampling, unchecked = [], [], []
    for step in range(args.steps + 1):
        # --alternate: every other step without the input checks (timed apart), in the same processes
        alternate = args.alternate and step % 2 == 0
        capg_rec.set_default_validate_args(not (args.no_validate or alternate))
        g = torch.Generator().manual_seed(step * 97 + rank)
        users = torch.randint(10_000, (args.batch,), generator=g)
        start = time.perf_counter()
        if loss_fn is None:  # in-batch softmax: the batch's users against their positives
            positives = torch.randint(args.num_items, (args.batch,), generator=g)
            kjt = KeyedJaggedTensor.from_lengths_sync([h.USER_ID, h.CATALOG], torch.cat([users, positives]),
                                                      torch.ones(2 * args.batch, dtype=torch.long))
            out = retriever.embeddings(kjt)
            scores = out[h.USER_ID].values() @ out[h.CATALOG].values().T  # [B, B]
            loss = torch.nn.functional.cross_entropy(scores, torch.arange(args.batch))
        else:
            drawn = time.perf_counter()
            if args.estimator.endswith("_sampled"):
                # this rank's negatives, looked up wherever their rows live, in one lookup: one sample to draw
                # the candidates from, a fresh one (and the candidates, exactly) for the loss
                draw, fresh = (DrawnSample(sampler.draw(args.num_items, None, generator=g, device=torch.device("cpu")),
                                           sampler) for _ in range(2))
                listed = torch.cat([draw.ids, fresh.ids]).unique()
                catalog = model(retriever.with_catalog(h.user_batch(users), items=listed), sample=draw)
                candidates = sample_candidates(catalog, args.candidates, generator=torch.Generator().manual_seed(step))
                sampled = time.perf_counter() - drawn
                catalog = catalog.resampled(fresh, head_items=candidates)
            else:
                catalog = model(retriever.with_catalog(h.user_batch(users)))
                drawn = time.perf_counter()
                candidates = sample_candidates(catalog, args.candidates, generator=torch.Generator().manual_seed(step))
                sampled = time.perf_counter() - drawn
            chosen = candidates[:, :2]
            rewards = torch.rand(chosen.shape, generator=torch.Generator().manual_seed(step))
            loss = loss_fn(catalog, candidates, chosen, rewards)
        if not sharded:
            optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if not sharded:
            optimizer.step()
        if sharded:
            dist.barrier()
        if alternate and step:
            unchecked.append(time.perf_counter() - start)
        elif step:  # the first step warms up
            times.append(time.perf_counter() - start)
            sampling.append(0.0 if loss_fn is None else sampled)
    result = {"mode": args.mode, "world_size": world, "rank": rank, "estimator": args.estimator,
              "step_s": statistics.median(times), "sample_s": statistics.median(sampling),
              "peak_rss_mb": _peak_mb(), "rss_growth_mb": _peak_mb() - base_mb,
              "item_rows": rows, "item_mb": rows * setup.width * 4 / 2**20,
              "unchecked_step_s": statistics.median(unchecked) if unchecked else None}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"{args.estimator}_{args.mode}_w{world}_r{rank}.json").write_text(json.dumps(result))
    if sharded:
        h.teardown(model)


def driver(args: argparse.Namespace) -> None:
    here = Path(__file__).resolve()
    common = ["--out", str(args.out), "--num-items", str(args.num_items), "--dim", str(args.dim),
              "--negatives", str(args.negatives),
              "--batch", str(args.batch), "--steps", str(args.steps), "--candidates", str(args.candidates),
              "--chunk-size", str(args.chunk_size), *(["--no-validate"] if args.no_validate else []),
              *(["--alternate"] if args.alternate else [])]
    path = os.pathsep.join(p for p in (str(here.parents[1]), os.environ.get("PYTHONPATH")) if p)  # this checkout
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": path}
    runs = []
    for estimator in ["in_batch", *args.estimators]:
        runs.append([sys.executable, str(here), "--worker", "--mode", "unsharded", "--estimator", estimator, *common])
        for world in args.worlds:
            runs.append([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                         str(here), "--worker", "--mode", "sharded", "--estimator", estimator, *common])
    for cmd in tqdm(runs, desc="configurations"):
        subprocess.run(cmd, check=True, env=env, cwd=here.parent, capture_output=True)
    results = [json.loads(p.read_text()) for p in sorted(Path(args.out).glob("*_w*_r*.json"))]
    for r in results:
        base = next(b for b in results if b["estimator"] == "in_batch" and
                    (b["mode"], b["world_size"], b["rank"]) == (r["mode"], r["world_size"], r["rank"]))
        r["step_over_in_batch"] = r["step_s"] / base["step_s"]
        r["sample_over_in_batch"] = r["sample_s"] / base["step_s"]
        r["users_per_s"] = args.batch * r["world_size"] / r["step_s"]
    results.sort(key=lambda r: (r["mode"] != "unsharded", r["world_size"], r["rank"],
                                ["in_batch", *args.estimators].index(r["estimator"])))
    from capg_rec.train.report import write_csv, write_json  # here: the measured processes import less

    write_json(Path(args.out) / "bench.json", {"config": vars(args) | {"out": str(args.out)}, "results": results})
    write_csv(Path(args.out) / "bench.csv", results)
    print(f"N={args.num_items:,} D={args.dim} B={args.batch}/rank K={args.candidates}, 1 thread/rank; "
          "ratios to the in-batch-softmax step of the same configuration")
    print(f"{'config':<14}{'rank':>5} {'estimator':<12}{'step s':>9}{'x in-batch':>11}{'sample s':>10}"
          f"{'x in-batch':>11}{'peak RSS MB':>13}{'item rows MB':>14}")
    for r in results:
        name = "unsharded" if r["mode"] == "unsharded" else f"sharded W={r['world_size']}"
        unchecked = "" if r["unchecked_step_s"] is None else f"  (checks off: {r['unchecked_step_s']:.3f} s)"
        print(f"{name:<14}{r['rank']:>5} {r['estimator']:<12}{r['step_s']:>9.3f}{r['step_over_in_batch']:>11.1f}"
              f"{r['sample_s']:>10.3f}{r['sample_over_in_batch']:>11.1f}{r['peak_rss_mb']:>13.0f}{r['item_mb']:>14.1f}"
              f"{unchecked}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--num-items", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch", type=int, default=128, help="users per rank")
    parser.add_argument("--candidates", type=int, default=10)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    parser.add_argument("--chunk-size", type=int, default=16_384)
    parser.add_argument("--negatives", type=int, default=1024, help="per rank, for the *_sampled estimators")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--no-validate", action="store_true",
                        help="capg_rec's input checks off (capg_rec.set_default_validate_args(False))")
    parser.add_argument("--alternate", action="store_true",
                        help="every other step with the checks off, timed apart (the checks' cost, in the same run)")
    parser.add_argument("--estimators", nargs="+", default=["vpg", "vpg_swr", "capg", "capg_plugin", "capg_swr"],
                        choices=["vpg", "vpg_swr", "capg", "capg_plugin", "capg_swr",
                                 "capg_sampled", "capg_swr_sampled"])
    parser.add_argument("--estimator", default="capg", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["unsharded", "sharded"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    (worker if args.worker else driver)(args)


if __name__ == "__main__":
    main()
