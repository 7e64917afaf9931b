"""pyarrow's first conversion between numpy and Arrow imports pandas where it is installed (its pandas
shim looks at every array-like it is given): ~0.3 CPU-s, paid inside the first group's encode (the
rollout worker) or decode (the trainer), on the path of the first step. `warm_up` pays it once ahead,
where a service waits anyway."""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def warm_up() -> None:
    """One conversion each way, as the codec makes them."""
    pa.array(np.zeros(1, dtype=np.int32)).to_numpy()
