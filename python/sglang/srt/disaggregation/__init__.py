"""Prefill/decode disaggregation (PD): a prefill server computes a prompt's KV and ships it, page by
page, into the KV pools of a decode server, which then decodes; a router pairs the two per request.

Modules (upstream names where upstream has them):
- `transfer.py`: the data plane behind one interface (`TransferBackend`): `fake` (in-process
  memmove, tests), `mooncake` (Mooncake Transfer Engine, TCP here, RDMA in production) and
  `cuda_ipc` (servers on one host's GPUs: device-to-device copies into the peer's mapped pools);
  `TransferWorker` runs the writes off the scheduler thread.
- `kv_layout.py`: what moves -- each pool's page payloads (MLA KV, index K of full IndexCache layers,
  the draft's KV), the metadata validated at the handshake, and the page-run copy list.
- `messages.py`: the control plane's typed messages (ZMQ, pickled).
- `prefill.py` / `decode.py`: the two schedulers (`Scheduler` subclasses plugged in at
  `on_prefill_finished` / admission; the process entry, `managers/scheduler_process.scheduler_class`,
  picks one), `router.py`: the HTTP router.

Protocol, per request (`bootstrap_room`): the decode server preallocates the prompt's pages and sends
`Register` (its pool layout, buffer addresses, destination pages) to the prefill server's bootstrap
port; the prefill server validates the layout (a mismatch is refused with a `Reject` naming the
field), and once the prompt is prefilled each prefill CP rank writes only the pages it owns and sends
`Done`; the decode server commits the request when every rank's `Done` has arrived.
"""

from __future__ import annotations

DISAGGREGATION_MODES = ["null", "prefill", "decode"]
TRANSFER_BACKENDS = ["mooncake", "cuda_ipc", "fake"]

