"""Host discovery: discovery sources and the pure host manager (order, blacklist, cooldown)."""
