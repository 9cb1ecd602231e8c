"""Front doors: the wire formats clients speak, each translated to one chat call upstream."""
