"""System metrics sampled each step (``system/*``): CPU %, RSS, and GPU utilisation/memory through NVML."""

from __future__ import annotations

import psutil
import torch


class SystemMonitor:
    def __init__(self) -> None:
        self.process = psutil.Process()
        self.process.cpu_percent(None)  # the first call only primes the counter
        self._nvml = None
        if torch.cuda.is_available():
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
            except Exception:  # NVML is optional: nvidia-ml-py missing or no driver access
                self._nvml = None

    def sample(self) -> dict[str, float]:
        memory = psutil.virtual_memory()
        metrics = {"cpu_percent": self.process.cpu_percent(None), "rss_gb": self.process.memory_info().rss / 2**30,
                   "host_memory_used_percent": memory.percent}
        if torch.cuda.is_available():
            metrics["gpu_memory_allocated_gb"] = torch.cuda.memory_allocated() / 2**30
            metrics["gpu_max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
            if self._nvml is not None:
                handle = self._nvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
                util = self._nvml.nvmlDeviceGetUtilizationRates(handle)
                info = self._nvml.nvmlDeviceGetMemoryInfo(handle)
                metrics["gpu_util"] = float(util.gpu)
                metrics["gpu_memory_util"] = 100.0 * info.used / info.total
        return metrics
