"""PyTorch's own distributed tests (``distributed_test.py``, shipped in the torch
wheel) against the fairring backend, as ``test_distributed_spawn.py`` runs
them for gloo: each test spawns WORLD_SIZE processes that init_process_group
with ``BACKEND`` through a file store.

``python -m pytest python/torch_suite -k "<selection>"``; the README lists the
selection CI runs and what passes. Tests hard-wired to gloo or nccl skip
themselves.
"""

import os
import tempfile

os.environ.setdefault("BACKEND", "fairring")
os.environ.setdefault("WORLD_SIZE", "2")
# The suite runs on CPU tensors; with a GPU visible it would skip every test
# needing fewer devices than ranks.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
if "TEMP_DIR" not in os.environ:
    _tmp = tempfile.mkdtemp(prefix="fairring-torch-suite-")
    for sub in ("barrier", "test_dir", "init_dir"):
        os.makedirs(os.path.join(_tmp, sub), exist_ok=True)
    os.environ["TEMP_DIR"] = _tmp

from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

# The feature sets are read by decorators when distributed_test is imported:
# declare fairring's before.
for feature in ("plugin", "ddp", "subgroup"):
    DistTestCases.backend_feature[feature].add("fairring")

import fairring  # noqa: E402,F401  (registers the backend in every spawned process)
from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


class TestDistBackendWithSpawnFairring(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    run_tests()
