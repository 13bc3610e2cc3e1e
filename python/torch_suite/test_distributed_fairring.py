"""PyTorch's own distributed tests (``distributed_test.py``, shipped in the torch
wheel) against the fairring backend, as ``test_distributed_spawn.py`` runs
them for gloo: each test starts WORLD_SIZE processes that init_process_group
with ``BACKEND`` through a file store. The processes are forked from a server
that has imported torch, the suite and fairring once, and are given the
environment the harness sets for the test, so each starts as a spawned one
would, in milliseconds rather than seconds.

``python -m pytest python/torch_suite -k "<selection>"``; docs/verification.md
("PyTorch's own distributed tests") lists the selection CI runs and what passes. Tests hard-wired to gloo or nccl skip
themselves.
"""

import json
import os
import tempfile
import unittest

import torch

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

import fairring  # noqa: E402,F401  (registers the backend in every rank's process)
from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


class TestDistBackendWithSpawnFairring(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def _spawn_processes(self):
        # As `spawn` starts them, but forked from a server that has imported
        # torch, the suite and fairring once: a rank starts in milliseconds
        # rather than a second or two of imports. What the harness sets per
        # test in the environment (TEMP_DIR, INIT_METHOD, MASTER_PORT) reaches
        # each rank through a file beside the test's own, which `_run` reads.
        with open(self.file_name + ".env", "w") as f:
            json.dump(dict(os.environ), f)
        context = torch.multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(
            ["torch", "torch.testing._internal.distributed.distributed_test", "fairring"]
        )
        self._start_processes(context.Process)

    def tearDown(self):
        super().tearDown()
        try:
            os.unlink(self.file_name + ".env")
        except FileNotFoundError:
            pass

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):
        with open(file_name + ".env") as f:
            environment = json.load(f)
        os.environ.clear()
        os.environ.update(environment)
        super()._run(rank, test_name, file_name, pipe, **kwargs)

    # PyTorch marks its CPU all-to-all tests MPI-only (gloo has no
    # all_to_all); fairring has them, so these run the same bodies (the
    # suite's own helpers, whole group, full group and subgroup) under
    # `_fairring` names.
    def test_all_to_all_fairring(self):
        self._test_all_to_all_helper(*self._init_global_test())

    def test_all_to_all_complex_fairring(self):
        self._test_all_to_all_helper(*self._init_global_test(), dtype=torch.cfloat)

    def test_all_to_all_full_group_fairring(self):
        self._test_all_to_all_helper(*self._init_full_group_test())

    def test_all_to_all_group_fairring(self):
        # Ranks 1 and 2 as a subgroup: PyTorch's own version waits for 8
        # ranks (`skip_if_small_worldsize`) unless on MPI.
        if int(os.environ["WORLD_SIZE"]) < 3:
            raise unittest.SkipTest("the subgroup of ranks 1 and 2 needs 3 ranks")
        self._test_all_to_all_helper(*self._init_group_test())

    def test_all_to_all_single_equal_split_fairring(self):
        self._test_all_to_all_single_equal_split_helper(*self._init_global_test())

    def test_all_to_all_single_equal_split_complex_fairring(self):
        self._test_all_to_all_single_equal_split_helper(
            *self._init_global_test(), dtype=torch.cfloat
        )

    def test_all_to_all_single_equal_split_full_group_fairring(self):
        self._test_all_to_all_single_equal_split_helper(*self._init_full_group_test())

    def test_all_to_all_single_unequal_split_fairring(self):
        self._test_all_to_all_single_unequal_split_helper(*self._init_global_test())

    def test_all_to_all_single_unequal_split_complex_fairring(self):
        self._test_all_to_all_single_unequal_split_helper(
            *self._init_global_test(), dtype=torch.cfloat
        )

    def test_all_to_all_single_unequal_split_full_group_fairring(self):
        self._test_all_to_all_single_unequal_split_helper(*self._init_full_group_test())


if __name__ == "__main__":
    run_tests()
