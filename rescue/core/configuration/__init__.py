"""A study's configuration: the settings model and its VLM part, the files it is read from, the one strict schema
every request goes through, the work a study may ask for, its identity (digests) and the `module:attr` names it
stores."""
