"""The reader: `.sx` text to forms, each stamped with its source location."""

from sexpgpu.reader.forms import Atom, Form, Keyword, List, Symbol, Vector
from sexpgpu.reader.read import read_file, read_text

__all__ = ["Atom", "Form", "Keyword", "List", "Symbol", "Vector", "read_file", "read_text"]
