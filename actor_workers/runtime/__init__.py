"""The actor runtime: actors exchanging registers by req/ack on stream threads (``engine``, ``actors``,
``linking``, ``group``), and the executor that turns a Plan into them (``executor``,
``tasks``, ``boxing_tasks``, ``variables``)."""
