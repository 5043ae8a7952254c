"""Every way lomo_ds moves bytes between ranks, behind one neutral interface; the engine and the
methods reach transports only through what this package exports.

  grad.py            the gradient routes of comm.grad_reduction (the collective reduce-scatter,
                     shared memory, the all-reduce baseline, one rank's direct path): a payload
                     to fill, a post that returns a handle, a handle whose wait gives the
                     non-finite verdict; "step straight from the rows" as a capability
  payload.py         the rank-major payload and its non-finite flag
  step_sums.py       the step's small agreements (loss, norm, verdict)
  param_gather.py    ZeRO-3's parameter all-gather route of every engine (comm.param_gather)
  int8_gather.py     8-bit weight shards (memory.int8_shards): their conversion and their gather
  observe.py         where transports that bypass torch.distributed report what they carry
  shm_*.py           the shared-memory transports between CPU ranks of one node
"""
from lomo_ds.comm.grad import GradReduction, GradRoute, GradTransport, open_grad_transport, resolve_grad_route
from lomo_ds.comm.int8_gather import install_int8_shards
from lomo_ds.comm.param_gather import ParamRoute, abandon_param_gather, configure_param_gather
from lomo_ds.comm.payload import all_finite, nonfinite_marker
from lomo_ds.comm.step_sums import StepSums, open_step_sums

__all__ = ["GradReduction", "GradRoute", "GradTransport", "ParamRoute", "StepSums", "abandon_param_gather",
           "all_finite", "configure_param_gather", "install_int8_shards", "nonfinite_marker", "open_grad_transport",
           "open_step_sums", "resolve_grad_route"]
