"""The MLX backend: the model runner on Metal or MLX's CPU backend (`runner`), its load-time choices (`load`), the
check of the Metal kernels a model will launch (`kernel_checks`) and the host-BLAS path MLX's CPU backend runs its
projections on (`host_blas`). Kept import-free: models import
`host_blas`, and the runner imports the models."""
