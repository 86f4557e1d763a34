"""cpu_opt.graviton — placeholder until its issue lands."""
