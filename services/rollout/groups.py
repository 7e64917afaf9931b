"""A group's padded arrays built in one go with numpy, for the built-in workflows.

The same arrays, dtypes and padding as `concat_padded([turn_tensors(...), ...])` (`tensors.py`), so the
trajectory message is byte for byte the one those helpers give; but a group of 8 short samples costs a
dozen numpy calls instead of ~100 small torch ops, and the worker does not need torch at all. The
public helpers in `tensors.py` keep returning torch tensors for researchers' workflows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from services.rollout.tensors import Segment


@dataclass
class GroupBuilder:
    """Samples added one by one (`add_sample`, `add_turns`), then `arrays()`: the padded group."""

    _ids: list[int] = field(default_factory=list)
    _loss: list[int] = field(default_factory=list)
    _logp: list[float] = field(default_factory=list)
    _vers: list[int] = field(default_factory=list)
    _lengths: list[int] = field(default_factory=list)
    _rewards: list[float] = field(default_factory=list)
    _prompt_lens: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self._lengths)

    def add_sample(self, prompt_ids: Sequence[int], output_ids: Sequence[int], output_logprobs: Sequence[float],
                   output_versions: Sequence[int], reward: float) -> None:
        """One sample: the prompt, then the generated tokens (`tensors.sample_tensors`)."""
        if not (len(output_ids) == len(output_logprobs) == len(output_versions)):
            raise ValueError(
                f"output_ids ({len(output_ids)}), output_logprobs ({len(output_logprobs)}) and "
                f"output_versions ({len(output_versions)}) must have the same length"
            )
        self.add_turns([(prompt_ids, False, None, None), (output_ids, True, output_logprobs, output_versions)],
                       reward, len(prompt_ids))

    def add_turns(self, segments: Sequence[Segment], reward: float, prompt_len: int) -> None:
        """One sample from segments `(ids, generated, logprobs, versions)` (`tensors.turn_tensors`)."""
        n = 0
        for seg_ids, generated, seg_logp, seg_vers in segments:
            k = len(seg_ids)
            n += k
            self._ids.extend(seg_ids)
            self._loss.extend([1 if generated else 0] * k)
            self._logp.extend(seg_logp if generated and seg_logp is not None else [0.0] * k)
            self._vers.extend(seg_vers if generated and seg_vers is not None else [-1] * k)
        self._lengths.append(n)
        self._rewards.append(reward)
        self._prompt_lens.append(prompt_len)

    def arrays(self) -> dict[str, np.ndarray]:
        """The padded group (batch-first, right-padded with 0), keys and dtypes as `concat_padded` gives."""
        if not self._lengths:
            raise ValueError("GroupBuilder: no samples")
        lengths = np.array(self._lengths, dtype=np.int64)
        width = int(lengths.max())
        # True on each row's first `length` columns: scattering the flat token lists through it fills
        # the rows in order and leaves the padding at 0
        mask = np.arange(width) < lengths[:, None]

        def padded(values: list[int] | list[float], dtype: type) -> np.ndarray:
            out: np.ndarray = np.zeros(mask.shape, dtype=dtype)
            out[mask] = np.array(values, dtype=dtype)
            return out

        return {
            "input_ids": padded(self._ids, np.int64),
            "attention_mask": mask.astype(np.int64),
            "loss_mask": padded(self._loss, np.int64),
            "logprobs": padded(self._logp, np.float32),
            "versions": padded(self._vers, np.int64),
            "rewards": np.array(self._rewards, dtype=np.float32),
            "prompt_len": np.array(self._prompt_lens, dtype=np.int64),
        }
