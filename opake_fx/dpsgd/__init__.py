"""DP-SGD: per-example clipping, Gaussian noise, Poisson sampling and their accounting."""
