"""The CPU data plane: ``transport`` (the Transport), ``connect`` (endpoints, listening, dialing, the
handshake), ``links`` (one-way connections and their frames), ``mailbox`` (where received payloads wait),
``collectives`` (ring and direct all-reduce, reduce-scatter, all-gather, all-to-all)."""
