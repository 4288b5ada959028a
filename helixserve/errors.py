"""The one exception type for bad user input.

Anything a user can get wrong (a file, a field, a flag) raises `UserError` with a message
that names the file, the field path and the bad value. The CLI prints that one line and
exits 2; the API turns it into an HTTP 400 with the OpenAI error JSON.
"""


class UserError(ValueError):
    """Bad input from the user: message names the file, field and value."""
