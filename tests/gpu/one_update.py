"""One PPO update of the real DeepSpeed engine on fixed groups, its statistics printed as the last line
of JSON: run by tests/gpu/test_cuda.py once on the CPU in float32 and once on CUDA in bfloat16, each in
its own process (DeepSpeed's accelerator is chosen once per process)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.support.updates import one_update

if __name__ == "__main__":
    model, dtype = Path(sys.argv[1]), sys.argv[2]
    stats, _, weights, _ = one_update(model, dtype=dtype, zero_stage=0, logp_chunk_tokens=16, pack_sequences=True,
                                      gradient_checkpointing=True, max_tokens_per_microbatch=64)
    device = "cuda" if any(t.is_cuda for t in weights.values()) else "cpu"
    print(json.dumps({"device": device, **{k: float(v) for k, v in stats.items()}}))
