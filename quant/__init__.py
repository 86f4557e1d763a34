"""cpu_opt.quant — placeholder until its issue lands."""
