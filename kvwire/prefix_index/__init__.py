"""kvwire.prefix_index."""
