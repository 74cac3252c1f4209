"""STAND-IN of ``vllm_ascend/_310p/worker_310p.py`` (upstream commit 182b75ea84ff13ece27b57391331ef8935410aea): the
310P worker constructs the 310P runner (L32-40)."""

from vllm_ascend._310p.model_runner_310p import NPUModelRunner310
from vllm_ascend.worker.worker import NPUWorker


class NPUWorker310(NPUWorker):
    runner_cls = NPUModelRunner310
