"""The kernel boundary the model calls: picks an implementation for the tensors' device.

Only the torch references exist so far; `PAGEDSERVE_KERNELS=reference` will keep choosing
them once device kernels are added.
"""

from __future__ import annotations

from kernels.kv_write import write_kv_reference
from kernels.paged_attention import paged_attention_reference

paged_attention = paged_attention_reference
write_kv = write_kv_reference
