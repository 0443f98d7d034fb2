"""`codegen.run.audio.per_row`: a batch's clips handed to its rows (continuous batching makes
each row a request of its own), one clip per audio run in order, a clip without soft tokens
with the row of the next clip."""

import numpy as np
import pytest

from codegen.run.audio import per_row
from codegen.run.errors import RunError

AUDIO = 9


def test_clips_go_to_their_rows_runs():
    rows = [np.array([1, 9, 9, 2, 9]), np.array([3]), np.array([9, 9, 9, 4])]
    heard = [np.zeros(n, np.float32) for n in (800, 100, 1_600, 2_400)]  # 100: no soft tokens
    short = np.zeros(160, np.float32)
    clips = [heard[0], heard[1], heard[2], heard[3], short]
    got = per_row(rows, clips, AUDIO)
    assert [[len(c) for c in row] for row in got] == [[800, 100, 1_600], [], [2_400, 160]]
    with pytest.raises(RunError, match="3 audio clips with soft tokens .of 4 given. but the "
                       "prompts hold 2 audio runs"):  # fmt: skip
        per_row(rows[:2], clips[:4], AUDIO)
    with pytest.raises(RunError, match="audio clip 1 has 480001 samples"):
        per_row(rows, [heard[0], np.zeros(480_001, np.float32)], AUDIO)
