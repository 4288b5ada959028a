"""What the cost model leaves out, timed on this host (1 torch thread, demo model):

- the last stage's extra work: final norm + lm_head (49152 x 576) + greedy sampling, as
  decode step time of the last 5 layers with the head over 5 middle layers;
- decode time vs context length (profiles time decode at a 128-token context).

    python -m benchmarks.rig.headcost
"""

from __future__ import annotations

import statistics
import time


def main() -> None:
    import torch

    from helixserve.engine import ShardEngine, WorkItem, prepare_demo_model
    from helixserve.request import SamplingParams

    torch.set_num_threads(1)
    model = prepare_demo_model()

    def step_ms(engine: ShardEngine, batch: int, context: int, sample: bool) -> float:
        ids = [f"r{context}-{i}" for i in range(batch)]
        sp = SamplingParams(temperature=0.0) if sample else None
        engine.step([WorkItem(r, engine.start_layer, engine.end_layer, 0, [0] * context,
                              torch.randn(context, engine.hidden_size), sampling=sp,
                              sample=False) for r in ids])
        times = []
        for k in range(9):
            items = [WorkItem(r, engine.start_layer, engine.end_layer, context + k, [0],
                              torch.randn(1, engine.hidden_size), sampling=sp, sample=sample)
                     for r in ids]
            t0 = time.perf_counter()
            engine.step(items)
            times.append(time.perf_counter() - t0)
        for r in ids:
            engine.free(r)
        return statistics.median(times) * 1e3

    middle = ShardEngine.load(model, 20, 25, "cpu", kv_cache_bytes=2**27)
    last = ShardEngine.load(model, 25, 30, "cpu", kv_cache_bytes=2**27)
    for batch in (1, 8):
        mid_ms, last_ms = step_ms(middle, batch, 128, False), step_ms(last, batch, 128, True)
        print(f"decode batch {batch}: 5 middle layers {mid_ms:.1f} ms, last 5 + head "
              f"{last_ms:.1f} ms: the head costs {5 * (last_ms / mid_ms - 1):.1f} layers")
    for batch in (1, 4):
        short, long = step_ms(middle, batch, 128, False), step_ms(middle, batch, 2000, False)
        print(f"decode batch {batch}: context 128 {short:.1f} ms, context 2000 {long:.1f} ms "
              f"({long / short:.2f}x)")


if __name__ == "__main__":
    main()
