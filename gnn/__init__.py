"""cpu_opt.gnn — placeholder until its issue lands."""
