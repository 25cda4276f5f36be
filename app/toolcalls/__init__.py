"""Tool calling shared by the front ends (the server and the chat app), with no web or UI library: the functions
offered (`tools.Tools`), JSON Schemas as the grammar takes them (`schemas`), and each model family's own tool-call
format (`tool_formats` and `formats/`: how tools and earlier calls reach the model, the grammar its reply is held
to, how the reply is read back)."""
