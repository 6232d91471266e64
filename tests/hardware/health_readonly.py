"""Read-only check of the health model on a real NVIDIA GPU host (issue 42; run by hand on a GPU host).

    PYTHONPATH=daemon:tests/hardware python3 tests/hardware/health_readonly.py

For each GPU: what NVML answers for NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (field 230) asked alone, what the
counters' batch read into GpuHealth.recovery_action, and the health verdict (watch/health.py) from that sample.
Through nvml_readonly.ReadOnlyNvml: only reads reach the cards. Prints JSON lines; exit 1 if any call was refused.
Not collected by pytest (no GPU in CI).
"""

import json
import sys

from nvml_readonly import REFUSED, ReadOnlyNvml

from gpuwarden.gpu.nvml import NvmlBackend
from gpuwarden.gpu.nvml_counters import COUNTER_FIELDS, VALUE_FIELDS
from gpuwarden.watch import health


def main() -> int:
    nvml = ReadOnlyNvml()
    backend = NvmlBackend(nvml, counters_interval_s=1.0)
    field = COUNTER_FIELDS["recovery_action"]
    print(json.dumps({"driver_version": backend.driver_version(), "gpus": len(backend.gpus()),
                      "nvml_fi_dev_get_gpu_recovery_action": getattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION",
                                                                     None)}))
    for gpu in backend.gpus():
        raw = nvml.nvmlDeviceGetFieldValues(gpu.handle, [field])[0]
        sample = gpu.sample(counters=True)
        verdict = health.judge(sample, health.Inputs(), 3)
        print(json.dumps({"gpu": gpu.index, "name": sample.name, "field": field, "nvml_return": raw.nvmlReturn,
                          "value_type": raw.valueType,
                          "raw_value": getattr(raw.value, VALUE_FIELDS[raw.valueType]) if raw.nvmlReturn == 0 else None,
                          "recovery_action": sample.health.recovery_action, **verdict.as_dict()}))
    backend.close()
    print(json.dumps({"refused": REFUSED}))
    return 1 if REFUSED else 0


if __name__ == "__main__":
    sys.exit(main())
