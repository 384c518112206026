"""``rlpost serve``: the Tinker API over a fleet on the Ray cluster.

Clients (the official ``tinker`` SDK, tinker-cookbook recipes) write their training loop and call
``forward_backward``, ``optim_step``, ``sample`` over HTTP; the service runs them on its actors:
one :class:`~rlpost.actors.adapters.AdapterTrainer` holding the base model and each client model's
LoRA adapter, and vLLM inference workers that sample with those adapters.

    app.py       the HTTP routes and the API key check
    service.py   what each request does (sessions, models, samplers, ordering by seq_id)
    futures.py   results a client polls for, and the per-model queue that runs requests in order
    wire.py      protobuf and JSON bodies
    storage.py   saved weights and optimizer states, by tenant, under the storage folder
    fleet.py     the service's actors: start, stop
    server.py    ``rlpost serve``: Ray, the fleet, the HTTP server, signals
"""
