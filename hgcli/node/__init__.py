"""Code that runs ON a node. Standard library only (torch imported lazily where measured/trained):
it is shipped to nodes content-addressed, and a node needs only Python (and torch)."""
