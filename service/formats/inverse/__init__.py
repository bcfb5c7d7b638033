"""Readers of kernel layouts: a converted layer's tensors back to the canonical form.

The source readers (`formats.readers`) read checkpoints; these read what our writers wrote,
so a layer kept in a kernel's layout can be checked against (and run by) the float32
reference. They sit above the writers and the registry, whose tables they invert.
"""
