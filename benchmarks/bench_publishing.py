"""Cost of publishing cache statistics per step: a 30-step Apply TeaCache run with the panel's events on and off.

"On" hands every event to a stand-in for ComfyUI's PromptServer that does what ``PromptServer.send_sync`` does on the
sampling thread (``loop.call_soon_threadsafe(queue.put_nowait, ...)``, an asyncio loop running in another thread, which
then JSON-encodes each message as the server's socket writer would). "Off" has no server. Interleaved, best of N.

Run: .venv/bin/python benchmarks/bench_publishing.py        (needs a ComfyUI checkout; prints markdown)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests")]
from omnitest.comfy_path import use_comfyui_in_process  # noqa: E402

if use_comfyui_in_process() is None:
    sys.exit("bench_publishing: no ComfyUI checkout (set COMFYUI_PATH)")
import torch  # noqa: E402

from omnitest import tiny_models  # noqa: E402
from omnitest.pack import pack_module, run_node  # noqa: E402

STEPS = 30


class LoopServer:
    """PromptServer.send_sync's path: hand the message to an asyncio loop in another thread, which encodes it."""

    client_id = "bench"

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.messages: asyncio.Queue | None = None
        self.sent = 0
        ready = threading.Event()

        def run():
            asyncio.set_event_loop(self.loop)
            self.messages = asyncio.Queue()
            self.loop.create_task(self._drain())
            ready.set()
            self.loop.run_forever()

        threading.Thread(target=run, daemon=True).start()
        ready.wait()

    async def _drain(self):
        while True:
            event, data, sid = await self.messages.get()
            json.dumps({"type": event, "data": data})
            self.sent += 1

    def send_sync(self, event, data, sid=None):
        self.loop.call_soon_threadsafe(self.messages.put_nowait, (event, data, sid))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    opts = parser.parse_args()
    store = pack_module("nodes.stats_store")
    node = pack_module("nodes.caches.teacache").ApplyTeaCache
    case = tiny_models.build_case("wan21_t2v", unet_overrides={"dim": 256, "ffn_dim": 1024, "num_heads": 2,
                                                               "num_layers": 4},
                                  latent_shape=(1, 16, 2, 16, 16))
    patched = run_node(node, model=case.patcher, rel_l1_thresh=0.0, start_percent=0.0, end_percent=1.0,
                       cache_device="compute device", model_variant="wan2.1_t2v_1.3B")[0]
    server = LoopServer()
    original = store._server
    times = {"events off": math.inf, "events on": math.inf}
    tiny_models.sample(case, model=patched, steps=STEPS)  # warm-up
    for _ in range(opts.repeats):
        for label, publisher in (("events off", lambda: None), ("events on", lambda: server)):
            store._server = publisher
            start = time.perf_counter()
            tiny_models.sample(case, model=patched, steps=STEPS)
            times[label] = min(times[label], time.perf_counter() - start)
    store._server = original
    time.sleep(0.2)
    off, on = times["events off"], times["events on"]
    print(f"Apply TeaCache (threshold 0: every step computed) on Wan dim 256, 4 blocks, 512 tokens, {STEPS} steps, "
          f"cfg {case.cfg}, CPU {torch.get_num_threads()} threads, best of {opts.repeats}; "
          f"{server.sent} events delivered\n")
    print("| events | run (s) | per step (ms) |")
    print("|---|---|---|")
    for label in times:
        print(f"| {label} | {times[label]:.3f} | {times[label] / STEPS * 1000:.2f} |")
    print(f"\nPublishing cost: {(on - off) / STEPS * 1e6:+.0f} µs per step ({(on / off - 1) * 100:+.1f}% of the run)")


if __name__ == "__main__":
    main()
