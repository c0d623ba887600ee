"""The ``liger`` backend: liger-kernel's vocabulary-parallel cross entropy and JSD."""
