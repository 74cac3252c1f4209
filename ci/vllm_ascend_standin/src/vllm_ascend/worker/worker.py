"""STAND-IN of ``vllm_ascend/worker/worker.py`` (upstream commit 182b75ea84ff13ece27b57391331ef8935410aea) over
vLLM 0.32's CPU worker: the worker constructs upstream's V1 runner (L476). (Upstream's V2 runner, L470-474, takes
the same caches and builder call: ``vllm_ascend/worker/v2/attn_utils.py`` L806-857, L222-265.)"""

import torch
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_ascend.worker.model_runner_v1 import NPUModelRunner


class NPUWorker(CPUWorker):
    runner_cls = NPUModelRunner

    def init_device(self):
        super().init_device()  # vLLM's CPU device setup (and its own runner, replaced here)
        self.use_v2_model_runner = False
        self.model_runner = self.runner_cls(self.vllm_config, torch.device("cpu"))
