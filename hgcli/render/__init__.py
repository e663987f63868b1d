"""The only code that prints for humans (rich), one module per command.
"""
