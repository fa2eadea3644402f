"""Generation from a live plan: a forward plan compiled once whose actors stay up between calls."""
