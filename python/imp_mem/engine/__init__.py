"""A reference inference engine whose whole memory is imp-mem's (issue 13).

The modules that run a model import torch when they are imported; this
package itself does not, so ``import imp_mem.engine`` works without torch.
"""
