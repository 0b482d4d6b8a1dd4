"""The numeric primitives every part builds on: FP8/FP4/INT8 formats and casts (``formats``), scale rules
(``scaling``), quantized tensors (``tensor``, ``grouped_tensor``), the Hadamard rotation (``hadamard``), the
training recipes and their scaling state (``recipes``, ``scaling_state``) and state-dict packing
(``state_dict``). Their public names are re-exported by ``fp8kit`` itself (``fp8kit.E4M3``, ``fp8kit.quantize``,
``fp8kit.DelayedScaling``, ...)."""
