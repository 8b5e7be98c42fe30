"""Units of memory, defined once: every byte count in flexengine is shown in binary GiB (what nvidia-smi, torch's
allocator statistics and /proc/meminfo's kB all count in), never in decimal GB.

A module of its own with no imports, so any layer (storage, data, the planner, the loop) can use it.
"""

MiB = 2**20  # bytes per MiB
GiB = 2**30  # bytes per GiB
