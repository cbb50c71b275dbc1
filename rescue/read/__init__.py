"""The read side: status, export, verify and the terminal and HTML reports. Imports only
`rescue.core` and `rescue.study`, so a read-side command never loads the runtime."""
