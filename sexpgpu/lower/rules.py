"""Every platform lowering rule, registered on import; `lowering(op, platform)` finds an op's."""

from sexpgpu.lower import attention, broadcast, matmul, xent  # noqa: F401  (each registers its rules)
from sexpgpu.lower.registry import lowering, platform_name, register_lowering, registered

__all__ = ["lowering", "platform_name", "register_lowering", "registered"]
