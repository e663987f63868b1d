"""The group engine: how a group of like devices trains together (torch DDP on the group's process
group, the samples-weighted comm hook, the step's small all-reduce, AMP's group-wide skip, gradient
accumulation's window, the group's own collectives, device emulation's pacing). It knows nothing of
parameter servers: what a group exchanges with them is ``runtime.exchange``'s."""
