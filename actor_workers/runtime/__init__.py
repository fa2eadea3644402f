"""The actor runtime: actors exchanging registers by req/ack on stream threads (``engine``, ``actors``,
``linking``, ``group``, ``trace``, ``errors``), and what a worker process sets around its kernels: BLAS
threads (``threads``), the heap's cycle collector (``heap``) and a GPU's streams (``cuda_streams``). The
executor that turns a Plan into actors is ``actor_workers/execution``."""
