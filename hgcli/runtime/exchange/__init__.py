"""What a group leader (and its members) does against the parameter servers: the gradient exchange,
its staging buffers, and the data position recorded with every push."""
